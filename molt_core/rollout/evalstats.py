"""Held-out evaluation arithmetic shared by ``molt run`` (its ``eval/*`` metrics) and ``molt eval``
(its report): per-sample seeds (training rollouts' too), per-task results, pass@k. One code path, so
``molt eval`` on a run's checkpoint reports the numbers the run logged at that step.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from molt_core.types import Trajectory

__all__ = ["eval_metrics", "eval_seed", "pass_at_k", "sample_seed", "success", "task_result"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, arXiv 2107.03374, eq. 1). Raises: ValueError if k > n."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_seed(split: str, run_seed: int, task_index: int, sample: int) -> int:
    """The sampling seed of sample ``sample`` of the task at ``task_index`` of ``split``: the first 63 bits
    (big-endian) of SHA-256 of ``"molt-<split>:<run_seed>:<task_index>:<sample>"``, a pure function of its
    arguments (a multi-turn episode adds the turn number).

    Args:
        split: ``"train"`` (``task_index``: 0-based in the run's :class:`~molt_core.rollout.tasks.TaskStream`,
            epochs included) or ``"eval"`` (the index in the eval split).

    Raises:
        ValueError: ``split`` is empty or contains ``":"``.
    """
    if not split or ":" in split:
        raise ValueError(f"split must be a non-empty name without ':' (e.g. 'train' or 'eval'), got {split!r}")
    h = hashlib.sha256(f"molt-{split}:{int(run_seed)}:{int(task_index)}:{int(sample)}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def eval_seed(run_seed: int, task_index: int, sample: int) -> int:
    """:func:`sample_seed` ``("eval", run_seed, task_index, sample)``."""
    return sample_seed("eval", run_seed, task_index, sample)


def success(t: Trajectory) -> float:
    """1.0 when a finished rollout solved its task (score, else reward, >= 1), else 0.0."""
    if t.status != "ok":
        return 0.0
    v = t.score if t.score is not None else t.reward
    return 1.0 if v is not None and v >= 1.0 - 1e-9 else 0.0


def task_result(index: int, task: dict[str, Any], trajectories: list[Trajectory]) -> dict[str, Any]:
    """One eval task's outcome as a JSON-able dict: ``index``, ``task``, ``n``, ``correct`` (:func:`success`),
    the finished samples' ``rewards``, ``failed`` and ``errors``."""
    return {"index": int(index), "task": task, "n": len(trajectories),
            "correct": int(sum(success(t) for t in trajectories)),
            "rewards": [float(t.reward) for t in trajectories if t.status == "ok" and t.reward is not None],
            "failed": sum(t.status != "ok" for t in trajectories),
            "errors": [t.error for t in trajectories if t.error]}


def eval_metrics(results: list[dict[str, Any]], k: int) -> dict[str, float]:
    """The ``eval/*`` metrics of :func:`task_result` dicts, in ``index`` order: ``pass@1``, ``pass@<k>`` (task
    means of the unbiased estimator), ``reward`` (finished samples' mean), ``failed``, ``rollouts``.

    Raises:
        ValueError: a task has fewer than ``k`` samples.
    """
    rs = sorted(results, key=lambda r: r["index"])
    p1 = [pass_at_k(r["n"], r["correct"], 1) for r in rs]
    pk = [pass_at_k(r["n"], r["correct"], k) for r in rs]
    rewards = [x for r in rs for x in r["rewards"]]
    return {"eval/pass@1": sum(p1) / max(1, len(p1)), f"eval/pass@{k}": sum(pk) / max(1, len(pk)),
            "eval/reward": sum(rewards) / max(1, len(rewards)), "eval/failed": float(sum(r["failed"] for r in rs)),
            "eval/rollouts": float(sum(r["n"] for r in rs))}
