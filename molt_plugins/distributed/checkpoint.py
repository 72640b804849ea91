"""A sharded trainer's checkpoint: the ``dcp/`` state tree, its writer
(:func:`save_sharded_checkpoint`, which writes the rest too) and its reader (:func:`load_dcp`).

A sharded checkpoint is the layout of :mod:`molt_core.train.checkpoint` (``model/`` -- the
*full* weights gathered onto rank 0, ``save_pretrained`` safetensors + tokenizer, loadable
by ``from_pretrained`` and servable by ``molt serve`` --, ``ref/``, ``critic/``,
``trainer_state.pt`` with schedulers, KL controller and RNG states, ``state.json`` with
``world_size``, ``checksums.json``) plus ``dcp/``: a ``torch.distributed.checkpoint`` of the
policy, its AdamW state, the reference and the critic (and its AdamW), each rank writing its
own shards. ``trainer_state.pt`` then holds no optimizer state (``optimizer`` is None): the
optimizers live in ``dcp/``.

Resume (:func:`load_dcp`, called by :func:`molt_core.train.checkpoint.load_checkpoint` through the
``fsdp2`` backend):
the distributed checkpoint is loaded into whatever sharding the resuming trainer has -- the
same world size (exact), another world size, or one plain :class:`Trainer` (DCP reshards the
tensors on load); :func:`molt_core.train.checkpoint.load_checkpoint` says when the world
size differs. The checkpoint directory must be on a file system every rank can write (one
node, or a shared file system).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule

from molt_core.train import model_files
from molt_core.train.checkpoint import begin_checkpoint, commit_checkpoint, cursor_json, write_checkpoint_files

__all__ = ["dcp_state", "full_state_dict", "load_dcp", "load_model", "load_optimizer", "save_sharded_checkpoint"]


def dcp_state(trainer: Any, parts: set[str] | None = None) -> dict[str, Any]:
    """The state dict tree ``{"model", "optim", "ref", "critic", "critic_optim"}`` of
    ``trainer`` (sharded DTensors for a sharded trainer), restricted to ``parts``."""
    state: dict[str, Any] = {}
    state["model"], state["optim"] = get_state_dict(trainer.model, trainer.optimizer)
    if trainer.ref_model is not None:
        state["ref"] = get_model_state_dict(trainer.ref_model)
    if trainer.critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(trainer.critic, trainer.critic_optimizer)
    return {k: v for k, v in state.items() if parts is None or k in parts}


def full_state_dict(module: Any) -> dict[str, Any]:
    """The full state dict of a sharded ``module`` gathered onto rank 0 (CPU tensors; a
    collective: every rank calls it; empty on the other ranks), with tied parameters
    (``lm_head.weight`` = ``model.embed_tokens.weight``) one tensor under both names as in a
    plain module's state dict -- the gather returns a copy per name, which
    ``save_pretrained`` would save and the weight packers would send twice."""
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        src = first.setdefault(id(p), name)
        if src != name and src in full and name in full:
            full[name] = full[src]
    return full


def load_dcp(trainer: Any, d: str | Path) -> None:
    """Load the ``dcp/`` distributed checkpoint ``d`` into ``trainer`` (sharded at any world
    size, or one plain trainer): policy and AdamW state, and the reference and the critic when
    the trainer has them.

    Raises:
        FileNotFoundError: ``d`` is not a distributed checkpoint, or it lacks a part the
            trainer needs (a critic for ``gae``).
    """
    d = Path(d)
    if not (d / ".metadata").is_file():
        raise FileNotFoundError(f"{d}: no distributed checkpoint (.metadata missing)")
    saved = {k.split(".", 1)[0] for k in dcp.FileSystemReader(str(d)).read_metadata().state_dict_metadata}
    want = {"model", "optim"} | ({"ref"} if trainer.ref_model is not None and "ref" in saved else set()) \
        | ({"critic", "critic_optim"} if trainer.critic is not None else set())
    if not want <= saved:
        raise FileNotFoundError(f"{d}: the distributed checkpoint lacks {sorted(want - saved)}")
    state = dcp_state(trainer, want)
    dcp.load(state, checkpoint_id=str(d))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "ref" in state:
        set_model_state_dict(trainer.ref_model, state["ref"])
    if "critic" in state:
        set_state_dict(trainer.critic, trainer.critic_optimizer, model_state_dict=state["critic"],
                       optim_state_dict=state["critic_optim"])
    if dist.is_initialized():
        dist.barrier()


def save_sharded_checkpoint(trainer: Any, run_dir: str | Path, data_cursor: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of a :class:`~molt_plugins.distributed.sharded.ShardedTrainer`
    (every rank calls it): ``dcp/`` by every rank (:func:`dcp_state`), the rest by rank 0
    (:func:`molt_core.train.checkpoint.write_checkpoint_files` of the gathered full state dicts);
    atomic like :func:`molt_core.train.checkpoint.save_checkpoint` (temp dir + rename, then pruned).

    Returns:
        The checkpoint directory (on every rank).

    Raises:
        TypeError: ``data_cursor`` is not JSON-serialisable.
    """
    cursor = cursor_json(data_cursor)
    rank0 = dist.get_rank() == 0
    paths: list[Any] = list(begin_checkpoint(run_dir, trainer.step, "sharded")) if rank0 else [None, None]
    dist.broadcast_object_list(paths, src=0)
    final, tmp = Path(paths[0]), Path(paths[1])
    dcp.save(dcp_state(trainer), checkpoint_id=str(tmp / "dcp"))
    full = {name: full_state_dict(m) for name, m in
            (("model", trainer.model), ("ref", trainer.ref_model), ("critic", trainer.critic)) if m is not None}
    if rank0:
        write_checkpoint_files(trainer, tmp, cursor, full=full, extra={"world_size": dist.get_world_size()})
        commit_checkpoint(trainer, run_dir, tmp, final)
    dist.barrier()
    return final


def load_model(model: torch.nn.Module, d: Path) -> None:
    """Load the ``*.safetensors`` of directory ``d`` (a plain checkpoint's ``model/``) into a
    sharded ``model``: full tensors into this rank's shards (a tied key saved once loads both);
    a plain module: :func:`molt_core.train.model_files.load_model`.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``d``.
        ValueError: weights for parameters the model lacks, or missing untied weights (checked
            before anything is loaded into a sharded model).
    """
    if not isinstance(model, FSDPModule):
        return model_files.load_model(model, d)
    state = model_files.read_weights(d)
    # the same key checks as the plain path, made before anything is loaded
    owner: dict[str, int] = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    live_keys = set(owner) | {n for n, _ in model.named_buffers()}
    unexpected = [k for k in state if k not in live_keys]
    if unexpected:
        raise ValueError(f"{d}: weights for unknown parameters {unexpected[:5]}; wrong model for this checkpoint?")
    saved = {owner[k] for k in state if k in owner}
    untied = [k for k in sorted(owner) if k not in state and owner[k] not in saved]
    if untied:
        raise ValueError(f"{d}: checkpoint lacks weights for {untied[:5]}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A plain checkpoint's optimizer ``state`` into the optimizer of a sharded ``model`` (a
    checkpoint of one rank resumed on several): the parameter indices of ``state`` become
    parameter names and each rank keeps its shard of every moment (``set_optimizer_state_dict``,
    full state dict); a plain module: ``optimizer.load_state_dict(state)``."""
    if not isinstance(model, FSDPModule):
        return model_files.load_optimizer(model, optimizer, state)
    names: dict[int, str] = {}
    for n, prm in model.named_parameters():
        names.setdefault(id(prm), n)
    fqns = [names[id(prm)] for g in optimizer.param_groups for prm in g["params"]]
    full = {"state": {fqns[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
