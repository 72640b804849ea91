"""One rank of the data-parallel parity tests (tests/test_distributed.py), run as a script.

``python tests/distributed_worker.py SPEC.json``: SPEC names ``rank``, ``world_size``,
``init_method``, ``config`` (a RunConfig dict), ``rollouts`` (a JSON file of Trajectory dicts,
one list per train step) and ``out`` (rank 0 writes the metrics of every step and the full
updated weights there with ``torch.save``); optional ``run_dir`` with ``save_after`` (write a
checkpoint after that many steps) or ``resume`` (a checkpoint to load first; then only the
steps after its ``step`` run); optional ``sft`` (``examples``, ``steps``, ``batch_size``, ``lr``
of a :func:`molt_core.train.sft.sft` warm start run first); optional ``replay_backend``
(``module:Class``, importable from tests/: the MoE routing-replay backend every rank uses);
optional ``poison_token`` (:func:`poison_after_first_step`).
"""

from __future__ import annotations

import json
import sys

import torch

torch.set_num_threads(1)


def poison_after_first_step(trainer, token: int) -> None:
    """From ``trainer``'s first optimizer step on, the policy's input embedding is NaN at every
    position holding id ``token`` (so is every later position of that row, through attention):
    a later PPO epoch's loss forward, not the recompute, sees the NaN."""
    on = []
    trainer.optimizer.register_step_post_hook(lambda opt, args, kwargs: on.append(True))
    trainer.model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: torch.where((args[0] == token)[..., None], torch.nan, out) if on else out)


def main(spec_path: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from molt_core.config import RunConfig
    from molt_plugins.distributed.sharded import ShardedTrainer, init_distributed
    from molt_core.types import Trajectory

    spec = json.loads(open(spec_path).read())
    init_distributed(spec["rank"], spec["world_size"], spec["init_method"], timeout_s=300)
    backend = None
    if spec.get("replay_backend"):
        import importlib

        mod, cls = spec["replay_backend"].split(":")
        backend = getattr(importlib.import_module(mod), cls)()
    trainer = ShardedTrainer(RunConfig.model_validate(spec["config"]), replay_backend=backend)
    if spec.get("poison_token") is not None:
        poison_after_first_step(trainer, spec["poison_token"])
    steps = [[Trajectory.model_validate(t) for t in step] for step in json.loads(open(spec["rollouts"]).read())]
    if spec.get("resume"):
        trainer.load_checkpoint(spec["resume"])
        steps = steps[trainer.step:]
    metrics = []
    if spec.get("sft"):  # a supervised warm start first: its per-step losses and grad norms lead the list
        from molt_core.train.sft import sft

        sft(trainer, [tuple(e) for e in spec["sft"]["examples"]], steps=spec["sft"]["steps"],
            batch_size=spec["sft"]["batch_size"], lr=spec["sft"]["lr"], log=lambda i, m: metrics.append(m))
    for step in steps:
        metrics.append(trainer.train_step(step))
        if spec.get("save_after") == trainer.step:
            trainer.save_checkpoint(spec["run_dir"], {"step": trainer.step})
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if spec["rank"] == 0:
        torch.save({"metrics": metrics, "weights": full}, spec["out"])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
