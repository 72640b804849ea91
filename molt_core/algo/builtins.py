"""The built-in advantage estimators and policy losses, registered through the same hooks a
third-party plugin uses (:func:`molt_core.hookspecs.molt_register_estimators`,
:func:`molt_core.hookspecs.molt_register_losses`); the plugin host always registers this module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from molt_core.algo.advantages import dr_grpo, gae, grpo, on_policy_distill, reinforce, reinforce_baseline, rloo, rloo_norm
from molt_core.algo.losses import cispo_token_loss, gspo_token_loss, ppo_token_loss

hookimpl = pluggy.HookimplMarker("molt")  # the marker of molt_core.hookspecs (algo/ imports no molt layer)

ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "rloo_norm": rloo_norm,
    "reinforce_baseline": reinforce_baseline,
    "reinforce": reinforce,
    "gae": gae,
    "on_policy_distill": on_policy_distill,
}
"""Built-in estimators by registered name (``algo.advantage``)."""

LOSSES: dict[str, Callable[..., Any]] = {"ppo": ppo_token_loss, "gspo": gspo_token_loss, "cispo": cispo_token_loss}
"""Built-in per-token policy losses by registered name (``algo.loss``)."""


@hookimpl
def molt_register_estimators(register: Callable[[str, Any], None]) -> None:
    """Register every built-in estimator of :data:`ESTIMATORS`."""
    for name, fn in ESTIMATORS.items():
        register(name, fn)


@hookimpl
def molt_register_losses(register: Callable[[str, Any], None]) -> None:
    """Register every built-in loss of :data:`LOSSES`."""
    for name, fn in LOSSES.items():
        register(name, fn)
