"""Policy-version semantics, the single enforcement site: :func:`staleness_gate` (once per step)
drops a whole rollout whose oldest sampled token is too stale, and :func:`correct` weights each
kept token by the behaviour -> proximal importance ratio ``rho = pi_prox / pi_behaviour``. Shapes: ``B``
rows (segments) of ``T`` tokens, ``mask[b, t]`` True on sampled tokens, ``seq_index[b]`` the rollout of
row ``b``. Semantics and sources: docs/architecture.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Correction", "Gate", "correct", "staleness_gate"]


@dataclass
class Correction:
    """Result of :func:`correct`.

    Attributes:
        keep: ``[B]`` bool, rows whose rollout passed the staleness gate.
        weights: ``[B, T]`` float32, detached importance weights; 0 on tokens not sampled, on
            dropped rows, out of support or rejected by ``is_mode = "mask"``.
        staleness: ``[B]`` long, ``current_version - oldest sampled-token version`` of the
            row's rollout (0 for a rollout without sampled tokens).
        metrics: ``invariants/staleness_max`` (every sampled token, before the gate),
            ``correction/staleness_max_kept`` (kept rows), ``correction/staleness_hist/<k>`` (row
            counts), ``correction/gate_dropped`` (rows), ``correction/gate_dropped_tokens``,
            ``correction/gated_frac`` and ``correction/out_of_support_frac`` (of all sampled
            tokens), ``correction/tokens`` (sampled tokens of kept rows), ``correction/masked_frac``
            and ``correction/clipped_frac`` (of those), ``correction/is_weight_mean`` / ``_min`` /
            ``_max`` (over ``loss_mask``), ``correction/log_ratio_abs_mean`` (mean ``|log pi_prox -
            log pi_behaviour|`` over kept in-support tokens, before the band).
        loss_mask: ``[B, T]`` bool, tokens the loss counts (its ``num_tokens``): sampled, kept by the
            gate, not rejected by mask mode (under trunc/clip an out-of-support token, weight 0).
        out_of_support: ``[B, T]`` bool, sampled tokens whose proximal logprob is -inf; the
            caller keeps them out of the gradient.
    """

    keep: Tensor
    weights: Tensor
    staleness: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    loss_mask: Tensor | None = None
    out_of_support: Tensor | None = None


def _check_mask(mask: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool [B, T] tensor, got {mask.dtype} shape {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def _check_gate(versions: Tensor, mask: Tensor, current_version: int, seq_index: Tensor | None) -> None:
    if versions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"versions must be an integer tensor (-1 where not sampled), got {versions.dtype}")
    if seq_index is not None:
        if seq_index.shape != mask.shape[:1] or seq_index.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"seq_index must be an integer [B] = [{mask.shape[0]}] tensor (row -> rollout), got "
                             f"{seq_index.dtype} shape {tuple(seq_index.shape)}")
        if seq_index.numel() and int(seq_index.min()) < 0:
            raise ValueError("seq_index must be >= 0 (row -> rollout index)")
    if current_version < 0:
        raise ValueError(f"current_version must be >= 0, got {current_version}")
    v = versions[mask]
    if v.numel():
        if int(v.min()) < 0:
            b, t = torch.nonzero(mask & (versions < 0))[0].tolist()
            raise ValueError(f"versions[{b}, {t}] = {int(versions[b, t])} on a sampled token (mask True); every "
                             f"sampled token must carry the policy version that sampled it")
        if int(v.max()) > current_version:
            b, t = torch.nonzero(mask & (versions > current_version))[0].tolist()
            raise ValueError(f"versions[{b}, {t}] = {int(versions[b, t])} is newer than current_version="
                             f"{current_version}; the trainer's version must be the latest published one")


def _check_weights(is_level: str, is_mode: str, low: float, high: float, behaviour_logprobs: Tensor,
                   proximal_logprobs: Tensor, mask: Tensor) -> None:
    if is_level != "off":
        if high < 1.0:
            raise ValueError(f"correction.high must be >= 1 (a weight of 1 = on-policy must pass), got {high}")
        if is_mode != "trunc" and not 0.0 <= low <= 1.0:
            raise ValueError(f"correction.low must lie in [0, 1] (a weight of 1 = on-policy must pass), got {low}")
    if bool(mask.any()):
        bl, pl = behaviour_logprobs[mask], proximal_logprobs[mask]
        if not torch.isfinite(bl).all():
            raise ValueError("behaviour_logprobs must be finite on sampled tokens (the engine sampled them, so "
                             "they had non-zero probability under the engine's own transform)")
        if not (torch.isfinite(pl) | (pl == -math.inf)).all():
            raise ValueError("proximal_logprobs must be finite or -inf (out of the recomputed support) on sampled "
                             "tokens; NaN or +inf means a broken forward")


def _per_sequence(x: Tensor, seq: Tensor, n_seq: int, reduce: str) -> Tensor:
    """Reduce the per-row ``x`` ``[B]`` over rows of the same sequence and broadcast back to rows."""
    init = {"amin": torch.iinfo(x.dtype).max if not x.is_floating_point() else math.inf, "sum": 0}[reduce]
    out = torch.full((n_seq,), init, dtype=x.dtype)
    out = out.scatter_reduce(0, seq, x, reduce=reduce, include_self=True)
    return out[seq]


@dataclass
class Gate:
    """Result of :func:`staleness_gate`: computed once per step, passed to every :func:`correct`.

    Attributes:
        keep: ``[B]`` bool, rows whose rollout passed the gate.
        staleness: ``[B]`` long, as :attr:`Correction.staleness`.
        seq: ``[B]`` long, row -> sequence (rollout). n_seq: number of sequences.
        metrics: the gate's metrics (see :class:`Correction`); empty for a :meth:`rows` slice.
    """

    keep: Tensor
    staleness: Tensor
    seq: Tensor
    n_seq: int
    metrics: dict[str, float] = field(default_factory=dict)

    def rows(self, rows: slice) -> "Gate":
        """The gate of the rows ``rows`` (a micro-batch), without metrics."""
        return Gate(self.keep[rows], self.staleness[rows], self.seq[rows], self.n_seq)


def staleness_gate(versions: Tensor, mask: Tensor, current_version: int, max_staleness: int,
                   seq_index: Tensor | None = None) -> Gate:
    """The sequence gate: a rollout whose oldest sampled token is more than ``max_staleness`` versions behind
    ``current_version`` is dropped, every row, and counted in the metrics. Returns a :class:`Gate`.

    Args:
        versions: ``[B, T]`` long, policy version that sampled each token, -1 where not sampled.
        mask: ``[B, T]`` bool, sampled tokens.
        current_version: the trainer's policy version (latest published).
        max_staleness: largest accepted staleness (``async.max_staleness``, >= 0).
        seq_index: optional ``[B]`` long, row -> rollout (``Batch.rollout_index``); None: every row
            is its own sequence.

    Raises:
        ValueError: shape/dtype mismatch; a sampled token with version -1 or newer than
            ``current_version``; a bad ``seq_index``.
    """
    _check_mask(mask, versions=versions)
    _check_gate(versions, mask, current_version, seq_index)
    B, T = mask.shape
    seq = torch.arange(B) if seq_index is None else seq_index.long()
    n_seq = int(seq.max()) + 1 if B else 0
    # on the OLDEST sampled-token version of the whole rollout
    big = torch.iinfo(torch.int64).max
    oldest_row = torch.where(mask, versions.long(), big).min(-1).values if T else torch.full((B,), big)
    oldest = _per_sequence(oldest_row, seq, n_seq, "amin")
    has_tok = oldest < big
    staleness = torch.where(has_tok, current_version - oldest, torch.zeros((), dtype=torch.long))
    keep = staleness <= max_staleness
    n_all = int(mask.sum())
    tok_stale = current_version - versions.long()[mask]
    st_all = staleness[has_tok & mask.any(-1)]
    st_kept = staleness[has_tok & mask.any(-1) & keep]
    gated = int((mask & ~keep[:, None]).sum())
    m: dict[str, float] = {
        "invariants/staleness_max": float(tok_stale.max()) if tok_stale.numel() else 0.0,
        "correction/staleness_max_kept": float(st_kept.max()) if st_kept.numel() else 0.0,
        "correction/gate_dropped": float((~keep & mask.any(-1)).sum()),
        "correction/gate_dropped_tokens": float(gated),
        "correction/gated_frac": gated / n_all if n_all else 0.0,
    }
    for k, c in zip(*torch.unique(st_all, return_counts=True)):
        m[f"correction/staleness_hist/{int(k)}"] = float(c)
    return Gate(keep=keep, staleness=staleness, seq=seq, n_seq=n_seq, metrics=m)


def correct(gate: Gate, behaviour_logprobs: Tensor, proximal_logprobs: Tensor, mask: Tensor, *,
            is_level: str = "token", is_mode: str = "trunc", low: float = 0.0, high: float = 2.0) -> Correction:
    """Behaviour -> proximal importance correction behind the step's ``gate``.
    Returns a :class:`Correction` (metrics: the gate's, then the weights').

    Level: ``off`` (weight 1), ``token`` (``rho_t``), ``seq`` (``prod_t rho_t`` over the rollout's
    sampled tokens, on all of them), ``geo`` (``exp(mean_t log rho_t)``). Mode, band ``[low, high]``:
    ``trunc`` (``min(rho, high)``), ``clip`` (``clamp(rho, low, high)``), ``mask`` (0 and out of
    ``loss_mask`` outside the band). TIS = token + trunc (Yao et al. 2025); IcePop = token + mask
    (Ling Team 2025); Seq-MIS = seq + mask (Li et al. 2025); references in docs/architecture.md.
    A token out of the recomputed support (proximal ``-inf``) has ratio 0 and never raises.

    Args:
        gate: the step's :func:`staleness_gate` (or its :meth:`Gate.rows` for a micro-batch).
        behaviour_logprobs: ``[B, T]`` float, logprob each token was sampled with (engine).
        proximal_logprobs: ``[B, T]`` float, trainer's logprobs at the current version before the
            update (``-inf`` outside the recomputed top-k/top-p support); detached here.
        mask: ``[B, T]`` bool, sampled tokens.
        is_level: ``off`` | ``token`` | ``seq`` | ``geo``. is_mode: ``mask`` | ``clip`` | ``trunc``.
        low, high: the band (floats; ``low <= 1 <= high``).

    Raises:
        ValueError: shape mismatch; a non-finite behaviour or NaN/+inf proximal logprob on a
            sampled token; a band that rejects weight 1; an unknown level or mode.
    """
    _check_mask(mask, behaviour_logprobs=behaviour_logprobs, proximal_logprobs=proximal_logprobs)
    _check_weights(is_level, is_mode, low, high, behaviour_logprobs, proximal_logprobs, mask)
    B, T = mask.shape
    seq, n_seq, keep = gate.seq, gate.n_seq, gate.keep
    live = mask & keep[:, None]  # sampled tokens of kept rows

    # (b) importance weights, float64; an out-of-support token has log rho = -inf (rho = 0)
    prox = proximal_logprobs.detach().double()
    oos = mask & (prox == -math.inf)
    log_rho = torch.where(mask & ~oos, prox - behaviour_logprobs.detach().double(), 0.0)
    log_rho = torch.where(oos, -math.inf, log_rho)
    if is_level == "off":
        log_w = torch.zeros_like(log_rho)
    elif is_level == "token":
        log_w = log_rho
    elif is_level == "seq":
        log_w = _per_sequence(log_rho.sum(-1), seq, n_seq, "sum")[:, None].expand(B, T)
    elif is_level == "geo":
        n_tok = _per_sequence(mask.sum(-1).double(), seq, n_seq, "sum")
        log_w = (_per_sequence(log_rho.sum(-1), seq, n_seq, "sum") / n_tok.clamp(min=1))[:, None].expand(B, T)
    else:
        raise ValueError(f"correction.is_level must be off/token/seq/geo, got {is_level!r}")

    rejected = torch.zeros_like(mask)
    changed = torch.zeros_like(mask)
    if is_level == "off":
        w = torch.ones_like(log_w)
    else:
        log_hi = math.log(high)
        log_lo = math.log(low) if low > 0 else -math.inf
        w = torch.exp(log_w)  # may be inf for a long seq product; every mode bounds it below
        if is_mode == "trunc":
            changed = log_w > log_hi
            w = torch.where(changed, high, w)
        elif is_mode == "clip":
            changed = (log_w > log_hi) | (log_w < log_lo)
            w = w.clamp(min=low, max=high)
        elif is_mode == "mask":
            # ratio 0 (out of support) is outside every band, even low = 0
            rejected = (log_w > log_hi) | (log_w < log_lo) | (log_w == -math.inf)
            w = torch.where(rejected, 0.0, w)
        else:
            raise ValueError(f"correction.is_mode must be mask/clip/trunc, got {is_mode!r}")
    if is_mode == "mask":  # at every level, "off" included: mask is the mode that rejects
        rejected = rejected | oos
    loss_mask = live & ~rejected
    weights = torch.where(loss_mask & ~oos, w, 0.0).to(torch.float32)

    # metrics: the gate's first, its staleness histogram last
    n_all = int(mask.sum())
    n_live = int(live.sum())
    aw = weights[loss_mask].double()
    hist = {k: v for k, v in gate.metrics.items() if k.startswith("correction/staleness_hist/")}
    m = {k: v for k, v in gate.metrics.items() if k not in hist}
    m.update({
        "correction/out_of_support_frac": float(oos.sum()) / n_all if n_all else 0.0,
        "correction/tokens": float(n_live),
        "correction/masked_frac": float((rejected & live).sum()) / n_live if n_live else 0.0,
        "correction/clipped_frac": float((changed & live).sum()) / n_live if n_live else 0.0,
        "correction/is_weight_mean": float(aw.mean()) if aw.numel() else 0.0,
        "correction/is_weight_min": float(aw.min()) if aw.numel() else 0.0,
        "correction/is_weight_max": float(aw.max()) if aw.numel() else 0.0,
        "correction/log_ratio_abs_mean": float(log_rho[live & ~oos].abs().mean()) if bool((live & ~oos).any()) else 0.0,
    })
    m.update(hist)
    return Correction(keep=keep, weights=weights, staleness=gate.staleness, metrics=m, loss_mask=loss_mask,
                      out_of_support=oos)
