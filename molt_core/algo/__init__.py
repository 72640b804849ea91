"""RL algorithms in plain PyTorch: advantages, policy losses, KL, and the policy-version
correction (staleness gate + importance weights). Pure functions; see each module."""

from molt_core.algo.advantages import compute_advantages
from molt_core.algo.correction import Correction, apply_correction
from molt_core.algo.kl import AdaptiveKLController, kl_estimate, kl_loss
from molt_core.algo.losses import aggregate_tokens, policy_loss

__all__ = [
    "compute_advantages",
    "policy_loss",
    "aggregate_tokens",
    "kl_estimate",
    "kl_loss",
    "AdaptiveKLController",
    "apply_correction",
    "Correction",
]
