"""KL-to-reference estimators (k1, k2, k3) and the adaptive KL coefficient controller.

With ``log r = ref_logprobs - logprobs`` at the sampled token (J. Schulman, "Approximating KL Divergence",
2020, http://joschu.net/blog/kl-approx.html): ``k1 = -log r`` (unbiased, any sign), ``k2 = (log r)^2 / 2``
(biased, >= 0), ``k3 = (r - 1) - log r`` (unbiased, >= 0); for a reward penalty or a loss term (:func:`kl_loss`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from molt_core.algo.losses import LOG_RATIO_BOUND, aggregate_tokens

__all__ = ["kl_estimate", "kl_loss", "AdaptiveKLController", "LOG_RATIO_BOUND", "LOG_RATIO_MAX"]

#: Every estimator clamps ``log r`` to ``[-LOG_RATIO_MAX, LOG_RATIO_MAX]`` nats first.
LOG_RATIO_MAX = 1e4


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` at the sampled tokens.

    Args:
        logprobs: ``[B, T]`` float, current-policy logprob (natural log) of each sampled token.
        ref_logprobs: ``[B, T]`` float, reference-policy logprob of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (module docstring).

    Returns:
        ``[B, T]`` in nats, the inputs' dtype (float32 for float16/bfloat16), differentiable, and
        finite for finite inputs: ``log r`` is clamped to +-``LOG_RATIO_MAX``, and k3 continues by its
        tangent above ``LOG_RATIO_BOUND`` (20 nats, verl's ``low_var_kl`` bound; at most 4.84e12).

    Raises:
        ValueError: unknown estimator or mismatched shapes.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"ref_logprobs must have the shape of logprobs {tuple(logprobs.shape)}, "
                         f"got {tuple(ref_logprobs.shape)}")
    if logprobs.dtype in (torch.float16, torch.bfloat16):
        logprobs = logprobs.float()
    if ref_logprobs.dtype in (torch.float16, torch.bfloat16):
        ref_logprobs = ref_logprobs.float()
    log_r = (ref_logprobs - logprobs).clamp(-LOG_RATIO_MAX, LOG_RATIO_MAX)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        b = LOG_RATIO_BOUND
        # expm1 up to the bound, its tangent e^b * (x - b) beyond it (value and slope continuous)
        return torch.expm1(log_r.clamp(max=b)) + math.exp(b) * torch.relu(log_r - b) - log_r
    raise ValueError(f"algo.kl_estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, num_tokens: int, estimator: str = "k3") -> Tensor:
    """KL loss term, a scalar tensor: ``sum_{mask} kl_estimate(...) / num_tokens`` (global token mean,
    like :func:`molt_core.algo.losses.apply_policy_loss`). Multiply by ``kl_coef`` before adding.

    Args:
        logprobs: ``[B, T]`` (requires grad). ref_logprobs: ``[B, T]`` (detached here).
        mask: ``[B, T]`` bool. num_tokens: global action-token count of the optimizer step.

    Raises:
        ValueError: as :func:`kl_estimate` and :func:`molt_core.algo.losses.aggregate_tokens`.
    """
    return aggregate_tokens(kl_estimate(logprobs, ref_logprobs.detach(), estimator), mask, num_tokens)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``coef <- coef * (1 + e * n_steps / horizon)``: at
    most 20 % per ``horizon`` steps, up when the KL is above ``target``, down below it.

    Args:
        init_coef: starting coefficient (>= 0). target: KL target in nats (> 0).
        horizon: steps over which a full proportional correction applies (> 0).

    Raises:
        ValueError: a bad argument, naming it.
    """

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if init_coef < 0:
            raise ValueError(f"init_coef (algo.kl_coef) must be >= 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"target (algo.kl_target) must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon (algo.kl_horizon) must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Update from the KL measured over the last ``n_steps`` steps; returns the new coefficient.

        A KL of ``+inf`` counts as far above target (error clipped to +0.2); a NaN KL leaves the
        coefficient unchanged.
        """
        kl = float(current_kl)
        if math.isnan(kl):
            return self.value
        err = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """Checkpointable state (``value``, ``target``, ``horizon``)."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore :meth:`state_dict` output."""
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])
