"""Policy-gradient losses (PPO clip with dual clip, GSPO, CISPO) with global-token aggregation.

Per-token terms ``l[b, t]`` times the detached importance weight ``w[b, t]`` (:mod:`molt_core.algo.correction`)
are aggregated as ``sum_{mask} l * w / num_tokens``, ``num_tokens`` the action tokens of the whole optimizer
step; the ratio is against the proximal policy (decoupled PPO, Hilton et al. 2021, arXiv 2110.00641).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: Bound (nats) on every log ratio before it is exponentiated in ``molt_core.algo`` (here and k3 in
#: :mod:`molt_core.algo.kl`): ``exp(20) = 4.85e8`` is finite in float32/bfloat16; verl clamps to [-20, 20].
LOG_RATIO_BOUND = 20.0

__all__ = ["LOG_RATIO_BOUND", "bounded_ratio", "apply_policy_loss", "loss_params", "aggregate_tokens", "ppo_token_loss", "gspo_token_loss", "cispo_token_loss"]


def aggregate_tokens(per_token: Tensor, mask: Tensor, num_tokens: int) -> Tensor:
    """``sum(per_token[mask]) / num_tokens`` -- the global-token-mean aggregation.
    Returns a scalar tensor (differentiable through ``per_token``).

    Args:
        per_token: ``[B, T]`` float per-token loss.
        mask: ``[B, T]`` bool, tokens that count.
        num_tokens: global count of action tokens in the optimizer step (>= ``mask.sum()``, >= 1).

    Raises:
        ValueError: ``num_tokens`` < 1 or smaller than this micro-batch's own token count.
    """
    n_local = int(mask.sum())
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int (the optimizer step's global action-token count), "
                         f"got {num_tokens!r}")
    if n_local > num_tokens:
        raise ValueError(f"num_tokens={num_tokens} is smaller than this micro-batch's {n_local} masked tokens; "
                         f"pass the GLOBAL action-token count of the whole optimizer step")
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype)).sum() / num_tokens


def bounded_ratio(log_ratio: Tensor) -> Tensor:
    """``exp(clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))``: an always finite importance ratio.

    Bias: a token whose ``|log_ratio|`` exceeds 20 nats gets the ratio at the bound and no
    gradient through it; unbounded, one such token makes the loss ``inf`` or its gradient NaN.

    Args:
        log_ratio: any-shape float tensor (nats), e.g. ``logprobs - proximal_logprobs``.

    Returns:
        Tensor of the same shape and dtype, in ``[e^-20, e^20]`` (NaN stays NaN).
    """
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_token_loss(logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, *, clip_low: float,
                   clip_high: float, dual_clip: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, arXiv 1707.06347, eq. 7).

    ``r = exp(logprobs - proximal_logprobs)`` (:func:`bounded_ratio`), ``l = -min(r A, clip(r,
    1 - clip_low, 1 + clip_high) A)`` (asymmetric band: DAPO's "clip-higher", arXiv 2503.14476).
    Dual clip (Ye et al. 2020, arXiv 1912.09729): for ``A < 0`` the loss is capped at
    ``-dual_clip * A`` (``dual_clip > 1``), so a huge ratio cannot blow up the update.

    Returns:
        ``(l [B, T], flags)``: bool ``[B, T]`` ``clipped_low``, ``clipped_high`` (the clipped branch
        is active: zero gradient), ``dual_clipped``, and the ``ratio``.
    """
    ratio = bounded_ratio(logprobs - proximal_logprobs)
    surr1 = ratio * advantages
    surr2 = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(surr1, surr2)
    r = ratio.detach()
    flags = {
        "ratio": r,
        "clipped_high": (advantages > 0) & (r > 1.0 + clip_high),
        "clipped_low": (advantages < 0) & (r < 1.0 - clip_low),
    }
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss.detach() > cap)
        loss = torch.where(dual, cap, loss)
        flags["dual_clipped"] = dual
    else:
        flags["dual_clipped"] = torch.zeros_like(r, dtype=torch.bool)
    return loss, flags


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Per-row mean of ``x`` over ``mask`` (0 for rows with no tokens); ``[B]``."""
    n = mask.sum(-1).clamp(min=1)
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype)).sum(-1) / n


def gspo_token_loss(logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                    clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO per token (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071).

    Sequence ratio ``s_b = exp(mean_t (logprobs - proximal_logprobs))`` over the row's sampled
    tokens, in the GSPO-token form (§4.3) so per-token advantages are allowed: ``s_bt = sg[s_b] *
    pi(y_t) / sg[pi(y_t)]`` (value ``s_b``, gradient ``s_b * grad log pi(y_t)``), ``l = -min(s_bt A,
    clip(s_bt, 1 - clip_low, 1 + clip_high) A)``. Each row is one sequence; ``log s_b`` is bounded
    (:func:`bounded_ratio`). The global token mean weighs longer sequences more than the paper's.
    Returns ``(l [B, T], flags)`` like :func:`ppo_token_loss` (``ratio`` is ``s_b`` per token).
    """
    log_r = logprobs - proximal_logprobs
    log_s = _seq_mean(log_r.detach(), mask)[:, None].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [B, 1]
    s = torch.exp(log_s + logprobs - logprobs.detach())
    surr1 = s * advantages
    surr2 = torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(surr1, surr2)
    r = s.detach().expand_as(log_r)
    return loss, {
        "ratio": r,
        "clipped_high": (advantages > 0) & (r > 1.0 + clip_high),
        "clipped_low": (advantages < 0) & (r < 1.0 - clip_low),
        "dual_clipped": torch.zeros_like(r, dtype=torch.bool),
    }


def cispo_token_loss(logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, *, clip_low: float,
                     clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO per token (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585).

    ``l = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logprobs`` (``r`` by :func:`bounded_ratio`):
    the weight is clipped and stop-gradiented, so every token keeps a gradient (unlike PPO's clip).
    Returns ``(l [B, T], flags)`` like :func:`ppo_token_loss` (``clipped_*`` = weight was clipped).
    """
    r = bounded_ratio(logprobs.detach() - proximal_logprobs)
    w = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    loss = -w * advantages * logprobs
    return loss, {
        "ratio": r,
        "clipped_high": r > 1.0 + clip_high,
        "clipped_low": r < 1.0 - clip_low,
        "dual_clipped": torch.zeros_like(r, dtype=torch.bool),
    }


#: What a registered loss may name: ``[B, T]`` tensors, then the numbers of the clip band.
LOSS_INPUTS = ("logprobs", "proximal_logprobs", "advantages", "mask")
LOSS_NUMBERS = ("clip_low", "clip_high", "dual_clip")


def loss_params(loss_fn: Callable[..., Any]) -> set[str]:
    """The parameters a registered policy loss names (:data:`LOSS_INPUTS` ∪ :data:`LOSS_NUMBERS`).

    Raises:
        ValueError: a parameter the dispatcher could not fill, or ``*args`` / ``**kwargs``.
    """
    out = set()
    for p in inspect.signature(loss_fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name not in (*LOSS_INPUTS, *LOSS_NUMBERS):
            raise ValueError(f"policy loss {getattr(loss_fn, '__name__', loss_fn)!r} takes {p.name!r}; a loss "
                             f"names only parameters from {', '.join((*LOSS_INPUTS, *LOSS_NUMBERS))}")
        out.add(p.name)
    return out


def apply_policy_loss(
    loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_weights: Tensor,
    num_tokens: int,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss of one micro-batch from a registered per-token ``loss_fn`` (calling
    convention: :func:`molt_core.hookspecs.molt_register_losses`), aggregated over the step.

    Args:
        loss_fn: the registered function; receives, by keyword, only what its signature names.
        logprobs: ``[B, T]`` float, current-policy logprob of each sampled token (requires grad).
        proximal_logprobs, advantages: ``[B, T]`` float, the logprob at the current version before
            the update and the advantage (constants: detached here).
        mask: ``[B, T]`` bool, tokens that count (sampled, kept by the gate).
        is_weights: ``[B, T]`` float, detached importance weights from correction (1 = none).
        num_tokens: global action-token count of the optimizer step (see module docstring).
        clip_low, clip_high: the band ``[1 - clip_low, 1 + clip_high]``. dual_clip: cap (> 1) or None.

    Returns:
        ``(loss, metrics)``: scalar loss = ``sum(l * is_weights over mask) / num_tokens``; metrics
        over this micro-batch's masked tokens: ``loss/pg`` (the loss), ``loss/tokens``,
        ``loss/clip_frac`` (low + high), ``loss/clip_frac_low`` / ``_high``, ``loss/dual_clip_frac``,
        ``loss/ratio_mean`` / ``_min`` / ``_max``, ``loss/approx_kl`` (k3 of proximal vs current).

    Raises:
        ValueError: ``dual_clip <= 1``, mismatched shapes, bad ``num_tokens``.
    """
    shape = logprobs.shape
    for name, x in (("proximal_logprobs", proximal_logprobs), ("advantages", advantages), ("mask", mask),
                    ("is_weights", is_weights)):
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(x.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"algo.dual_clip must be > 1 (Ye et al. use 3), got {dual_clip}")
    prox = proximal_logprobs.detach()
    adv = advantages.detach()
    given = {"logprobs": logprobs, "proximal_logprobs": prox, "advantages": adv, "mask": mask,
             "clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
    per_tok, flags = loss_fn(**{k: given[k] for k in loss_params(loss_fn)})
    loss = aggregate_tokens(per_tok * is_weights.detach(), mask, num_tokens)

    n = int(mask.sum())
    metrics: dict[str, float] = {"loss/pg": float(loss.detach()), "loss/tokens": float(n)}
    if n == 0:
        metrics.update({k: 0.0 for k in ("loss/clip_frac", "loss/clip_frac_low", "loss/clip_frac_high",
                                          "loss/dual_clip_frac", "loss/approx_kl")})
        metrics.update({"loss/ratio_mean": 1.0, "loss/ratio_min": 1.0, "loss/ratio_max": 1.0})
        return loss, metrics
    lo = float(flags["clipped_low"][mask].float().mean())
    hi = float(flags["clipped_high"][mask].float().mean())
    r = flags["ratio"][mask].double()
    log_r = (logprobs.detach() - prox)[mask].double().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics.update({
        "loss/clip_frac": lo + hi,
        "loss/clip_frac_low": lo,
        "loss/clip_frac_high": hi,
        "loss/dual_clip_frac": float(flags["dual_clipped"][mask].float().mean()) if "dual_clipped" in flags else 0.0,
        "loss/ratio_mean": float(r.mean()),
        "loss/ratio_min": float(r.min()),
        "loss/ratio_max": float(r.max()),
        "loss/approx_kl": float((torch.exp(-log_r) - 1.0 + log_r).mean()),
    })
    return loss, metrics
