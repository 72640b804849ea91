"""Example third-party advantage estimator for molt-sdk: ``grpo_batch_std``.

GRPO normalises each rollout's centred reward by the std of its own group; "Lite PPO"
(Z. Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
arXiv 2508.08221) keeps the **group mean** as the baseline but divides by the **batch std**
of the rewards, which they find the most robust normalisation (a group of near-identical
rewards is no longer blown up by its own tiny std)::

    A_i = (r_i - mean_{j in group(i)} r_j) / (std_batch(r) + eps)

Use it without installing: ``molt run quickstart --plugin path/to/molt_grpo_variant/__init__.py
--set algo.advantage=grpo_batch_std``, or ``pip install -e contrib/molt-grpo-variant`` and
``--set algo.advantage=grpo_batch_std``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from molt_core.hookspecs import hookimpl

__all__ = ["grpo_batch_std", "molt_register_estimators"]


def grpo_batch_std(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6, std_tol: float = 1e-6) -> Tensor:
    """Group-mean baseline, batch-std scale (Lite PPO, arXiv 2508.08221).

    Computed in float64. The batch std is the sample std (ddof = 1, as molt's ``grpo`` takes
    for a group) over the reward of every rollout of the step; a group whose own std is below
    ``std_tol`` gets exactly 0 (no rounding residue of its mean is scaled up), and a batch std
    below ``std_tol`` means no division (only centring).

    Example: groups ``{3, 1}`` and ``{2, 2}``: centred ``[1, -1, 0, 0]``; batch std of
    ``[3, 1, 2, 2]`` is ``sqrt(2/3)``; with ``eps = 0`` the advantages are
    ``[sqrt(3/2), -sqrt(3/2), 0, 0]`` (GRPO would give ``+-1/sqrt(2)`` for the first group).

    Args:
        rewards: ``[R]`` float, one reward per rollout.
        group_index: ``[R]`` int64, the group (prompt) of each rollout.
        eps: added to the batch std (``algo.adv_eps``).
        std_tol: a std below this counts as zero spread (``algo.std_tol``).

    Returns:
        ``[R]`` float64, one advantage per rollout (molt broadcasts it to the rollout's tokens).
    """
    r = rewards.to(torch.float64)
    centred = torch.zeros_like(r)
    for g in torch.unique(group_index):
        idx = torch.nonzero(group_index == g).flatten()
        x = r[idx]
        if x.numel() > 1 and float(x.std()) >= std_tol:
            centred[idx] = x - x.mean()
    s = float(r.std()) if r.numel() > 1 else 0.0
    return centred / (s + eps) if s >= std_tol else centred


@hookimpl
def molt_register_estimators(register: Callable[[str, Any], None]) -> None:
    """Register ``grpo_batch_std`` (``algo.advantage = "grpo_batch_std"``)."""
    register("grpo_batch_std", grpo_batch_std)
