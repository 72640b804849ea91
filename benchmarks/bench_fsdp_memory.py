"""Per-rank parameter + optimizer memory of the sharded trainer (FSDP2) at world sizes 1..N,
against one plain :class:`~molt_core.train.Trainer` measured in the same run.

For each world size ``n`` in ``--world-sizes``, ``n`` processes (gloo on CPU) each build a
:class:`~molt_plugins.distributed.sharded.ShardedTrainer` on the same model, take one optimizer
step on the same synthetic batch (so AdamW's moments exist), and report the bytes they hold
(:func:`molt_plugins.distributed.sharded.local_param_bytes`: their parameter shards and their
optimizer-state shards) and the time of a second step. The peer is one plain ``Trainer`` (world size 1,
no sharding) on the same batch, in this process. Printed per world size: the largest rank's
bytes, its ratio to the plain trainer's (the target is about ``1/n``; a rank holds
``ceil(rows / n)`` rows of every parameter's dim 0, so it is slightly more for small
tensors), and the median step time.

Usage: ``python benchmarks/bench_fsdp_memory.py [--model builtin:tiny-qwen3-large]
[--world-sizes 1,2] [--out bench_fsdp_memory.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # synthetic rollouts


def _config(model: str):
    from molt_core.config import RunConfig

    return RunConfig.model_validate({"model": {"path": model}, "run": {"steps": 3},
                                     "trainer": {"refuse_unverified": False, "micro_batch_size": 4}})


def _batch(version: int):
    """16 rollouts sampled (stamped) by ``version``, so no step is gated as stale."""
    from trainer_utils import synthetic_rollouts

    return synthetic_rollouts(0, n_groups=4, n_per_group=4, version=version)


def _rank(rank: int, world: int, init: str, model: str, out: str) -> None:
    torch.set_num_threads(1)
    from molt_plugins.distributed.sharded import ShardedTrainer, init_distributed, local_param_bytes

    init_distributed(rank, world, init)
    tr = ShardedTrainer(_config(model))
    tr.train_step(_batch(tr.version))  # warm-up (FSDP2 lazy init)
    t0 = time.perf_counter()
    assert tr.train_step(_batch(tr.version))["train/skipped"] == 0.0
    dt = time.perf_counter() - t0
    Path(f"{out}.{rank}").write_text(json.dumps({**local_param_bytes(tr), "step_s": dt}))
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny-qwen3-large")
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--out", default="bench_fsdp_memory.json")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    from molt_core.train import Trainer
    from molt_plugins.distributed.sharded import local_param_bytes

    plain = Trainer(_config(a.model))
    plain.train_step(_batch(plain.version))  # warm-up, as for the ranks
    t0 = time.perf_counter()
    assert plain.train_step(_batch(plain.version))["train/skipped"] == 0.0
    peer = {**local_param_bytes(plain), "step_s": time.perf_counter() - t0}
    base = peer["params"] + peer["optimizer"]
    rows = {"plain": peer}
    print(f"plain Trainer: params {peer['params']:,} B + optimizer {peer['optimizer']:,} B  "
          f"step {peer['step_s']:.2f} s")
    for n in [int(x) for x in a.world_sizes.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_rank, args=(n, f"file://{d}/rdzv", a.model, f"{d}/r"), nprocs=n)
            ranks = [json.loads(Path(f"{d}/r.{r}").read_text()) for r in range(n)]
        worst = max(r["params"] + r["optimizer"] for r in ranks)
        rows[f"world_size_{n}"] = {"ranks": ranks, "max_rank_bytes": worst, "ratio_to_plain": worst / base,
                                   "step_s_max": max(r["step_s"] for r in ranks)}
        print(f"world size {n}: largest rank params+optimizer {worst:,} B = {worst / base:.3f} x plain "
              f"(1/n = {1 / n:.3f})  step {rows[f'world_size_{n}']['step_s_max']:.2f} s")
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
