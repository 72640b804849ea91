"""Weight publish cost, by phase: the trainer's weights -> Ray object store -> the rollout
worker's engine, for the quickstart model and a larger builtin model, against a plain
in-process ``engine_model.load_state_dict(trainer_model.state_dict())`` measured in the same run.

Two payload formats are measured side by side, with the same actors:

* ``dict`` -- the previous publish: every tensor of the state dict cloned, the dict pickled by
  Ray tensor by tensor (a ``torch.save`` stream per storage);
* ``packed`` -- :meth:`molt_core.runtime.workers.TrainerWorker.weights` now: one flat byte
  buffer (:mod:`molt_core.runtime.weightpack`), moved by Ray as one out-of-band numpy buffer
  and read by the engine through views.

Phases (medians over ``--reps``):

* in process: ``weights`` (build the payload on the trainer side), ``put`` (``ray.put``),
  ``get`` (``ray.get`` of that ref in the same process), ``load`` (``engine.load_weights``,
  which queues the copy to the engine's worker thread and waits for it);
* ``publish`` -- end to end through Ray actors exactly as ``molt run``'s ``publish()`` does:
  ``TrainerWorker.weights`` with two returns, ``RolloutWorker.load_weights`` on those refs,
  ``ray.get``; the trainer and rollout worker are the real actors built from
  ``recipes/quickstart.toml`` (``sft.steps = 0``);
* ``noop`` -- one actor call with no payload (``RolloutWorker.load``): the floor of a Ray
  round trip (``publish`` chains two calls).

Ratios printed: each phase / the plain ``load_state_dict`` peer of the same model.

Usage: ``python benchmarks/bench_sync.py [--reps 30] [--models tiny-qwen3,tiny-qwen3-large]``.
Absolute times on a shared machine drift; quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]


def dict_payload(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The previous publish payload: every tensor cloned."""
    return {k: v.detach().clone() for k, v in state.items()}


def median_ms(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def config(model: str) -> Any:
    """The quickstart recipe with ``model``, no warm start, no eval."""
    from molt_core.config import RunConfig

    raw = tomllib.loads((ROOT / "recipes" / "quickstart.toml").read_text())
    raw["model"]["path"] = f"builtin:{model}"
    raw["sft"]["steps"] = 0
    raw["eval"]["n_problems"] = 0
    return RunConfig.model_validate(raw)


def in_process(model: str, reps: int) -> dict[str, float]:
    """Per-phase medians (ms) of both payloads and the plain peer, in this process."""
    import ray

    from molt_core.models import load_model
    from molt_core.runtime.weightpack import as_state_dict
    from molt_core.runtime.workers import RolloutWorker, TrainerWorker

    cfg = config(model)
    tw, rw = TrainerWorker(cfg), RolloutWorker(cfg)
    live = tw.trainer.weights()
    out: dict[str, float] = {}
    for fmt, make in (("dict", lambda: (dict_payload(live), 1)), ("packed", tw.weights)):
        payload, _ = make()
        ref = ray.put(payload)
        out[f"{fmt}/weights"] = median_ms(make, reps)
        out[f"{fmt}/put"] = median_ms(lambda: ray.put(payload), reps)
        out[f"{fmt}/get"] = median_ms(lambda: ray.get(ref), reps)
        got = ray.get(ref)
        out[f"{fmt}/load"] = median_ms(lambda: rw.engine.load_weights(as_state_dict(got), 1), reps)
        del ref, got
    a, b = load_model(f"builtin:{model}", seed=1), load_model(f"builtin:{model}", seed=2)
    out["plain/load_state_dict"] = median_ms(lambda: b.load_state_dict(a.state_dict()), reps)
    rw.engine.close()
    return out


def through_ray(model: str, reps: int) -> dict[str, float]:
    """End-to-end publish medians (ms) through the real actors, both payloads, and one
    no-payload actor call."""
    import ray

    from molt_core.runtime.weightpack import PackedState, unpack_state
    from molt_core.runtime.workers import RolloutWorker, TrainerWorker

    class DictTrainer(TrainerWorker):
        def weights(self):  # the previous payload
            state, version = super().weights()
            return dict_payload(unpack_state(state) if isinstance(state, PackedState) else state), version

    cfg = config(model).model_dump(by_alias=True)
    out: dict[str, float] = {}
    worker = ray.remote(RolloutWorker).options(num_cpus=0, max_concurrency=1000).remote(cfg, 0)
    for fmt, cls in (("dict", DictTrainer), ("packed", TrainerWorker)):
        trainer = ray.remote(cls).options(num_cpus=0).remote(cfg)

        def publish() -> int:
            s, v = trainer.weights.options(num_returns=2).remote()
            return ray.get([worker.load_weights.remote(s, v)])[0]

        out[f"{fmt}/publish"] = median_ms(publish, reps, warmup=3)
        ray.kill(trainer)
    out["noop/round_trip"] = median_ms(lambda: ray.get([worker.load.remote()]), reps, warmup=3)
    ray.kill(worker)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--models", default="tiny-qwen3,tiny-qwen3-large")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from molt_core.runtime.raycluster import init_ray

    torch.set_num_threads(1)
    ray = init_ray(config(args.models.split(",")[0]), None)  # a fresh local cluster, as `molt run` starts
    res: dict[str, dict[str, float]] = {}
    for m in args.models.split(","):
        r = {**in_process(m, args.reps), **through_ray(m, args.reps)}
        res[m] = r
        peer = r["plain/load_state_dict"]
        print(f"\n{m}: plain load_state_dict {peer:.2f} ms (the peer)")
        print(f"  {'phase':<12}{'dict ms':>10}{'packed ms':>11}{'dict/peer':>11}{'packed/peer':>13}")
        for ph in ("weights", "put", "get", "load", "publish"):
            d, p = r[f"dict/{ph}"], r[f"packed/{ph}"]
            print(f"  {ph:<12}{d:>10.2f}{p:>11.2f}{d / peer:>11.1f}{p / peer:>13.1f}")
        print(f"  one no-payload actor call: {r['noop/round_trip']:.2f} ms")
    ray.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
