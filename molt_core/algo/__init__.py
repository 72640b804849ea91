"""RL algorithms in plain PyTorch: advantages, policy losses, KL, and the policy-version
correction (staleness gate + importance weights). Pure functions of tensors and numbers;
the estimators and losses are looked up by name in the plugin host's registries."""

from molt_core import _moved
from molt_core.algo.advantages import estimate_advantages
from molt_core.algo.correction import Correction, Gate, correct, staleness_gate
from molt_core.algo.kl import AdaptiveKLController, kl_estimate, kl_loss
from molt_core.algo.losses import aggregate_tokens, apply_policy_loss

__all__ = [
    "estimate_advantages",
    "apply_policy_loss",
    "aggregate_tokens",
    "kl_estimate",
    "kl_loss",
    "AdaptiveKLController",
    "staleness_gate",
    "correct",
    "Gate",
    "Correction",
]


def __getattr__(name: str) -> object:
    """Estimator-section wrappers that moved to :mod:`molt_core.train.algorithms` (deprecated here)."""
    return _moved.moved_attr(__name__, name)
