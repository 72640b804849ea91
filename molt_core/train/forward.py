"""Policy forwards: the logprob of each sampled token under its span's sampling transform.

:func:`token_logprobs` turns logits into those logprobs (the engine's transform, so identical
weights give a ratio of exactly 1); :func:`forward_rows` runs one micro-batch through a model,
sharing a prompt prefix its rows have in common; :func:`recompute_logprobs` a whole batch, no grad.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import Any, Sequence

import torch

from molt_core.models import cache_keyword, length_dependent_rope, returned_cache
from molt_core.sampling import processed_logprobs
from molt_core.train.ingress import Batch

__all__ = ["forward_rows", "image_inputs", "model_vocab", "recompute_logprobs", "shared_prefix", "token_logprobs"]

_log = logging.getLogger("molt.forward")


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    param_ids: torch.Tensor,
    params: Sequence[tuple[float, int, float]],
    with_entropy: bool = False,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each sampled token under its span's processed distribution.

    Args:
        logits: ``[B, K, V]`` model outputs for positions ``offset .. offset + K - 1`` (logits at
            ``t - 1`` predict token ``t``; ``K = T``, ``offset = 0`` for a full forward).
        input_ids: ``[B, T]`` int64 token ids.
        param_ids: ``[B, T]`` int64, index into ``params`` for sampled tokens, -1 elsewhere
            (position 0 must be -1).
        params: ``(temperature, top_k, top_p)`` per index (:func:`molt_core.sampling.processed_logprobs`).
        with_entropy: also return the entropy (nats, no grad) of the processed distribution.

    Returns:
        ``(logprobs, entropy)``: ``[B, T]`` float32 (0 where not sampled; differentiable
        w.r.t. ``logits``), and ``[B, T]`` float32 or None.

    Example (B08): logits ``[2, 1, 0]``, T = 0.5 -> logprob of token 0 = -0.142932.
    """
    B, T = input_ids.shape
    out = torch.zeros((B, T), dtype=torch.float32, device=logits.device)
    ent = torch.zeros((B, T), dtype=torch.float32, device=logits.device) if with_entropy else None
    for c, (temp, top_k, top_p) in enumerate(params):
        bi, ti = (param_ids == c).nonzero(as_tuple=True)
        if bi.numel() == 0:
            continue
        lp = processed_logprobs(logits[bi, ti - 1 - offset], temp, top_k, top_p)  # [N, V]
        tok = lp.gather(-1, input_ids[bi, ti].unsqueeze(-1)).squeeze(-1)
        out = out.index_put((bi, ti), tok)
        if ent is not None:
            with torch.no_grad():
                ent[bi, ti] = torch.special.entr(lp.detach().exp()).sum(-1)
    return out, ent


def accepts(model: torch.nn.Module, arg: str) -> bool:
    """Whether ``model.forward`` takes keyword ``arg`` (cached per model class; a peft model:
    its base model's ``forward``)."""
    cls = type(model)
    cache = _ACCEPTS.setdefault(cls, {})
    if arg not in cache:
        try:
            inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes kwargs on
            cache[arg] = arg in inspect.signature(inner.forward).parameters
        except (TypeError, ValueError):
            cache[arg] = False
    return cache[arg]


_ACCEPTS: dict[type, dict[str, bool]] = {}


def model_vocab(model: torch.nn.Module) -> int | None:
    """Rows of the output embedding (the logits' vocabulary), else ``config.vocab_size``, else None."""
    emb = getattr(model, "get_output_embeddings", lambda: None)()
    if emb is not None and hasattr(emb, "weight"):
        return int(emb.weight.shape[0])
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vocab_size", None)


def shared_prefix(ids: torch.Tensor, pids: torch.Tensor, min_saving: float = 0.1
                  ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """The prompt prefix a micro-batch's rows share, to run once per distinct prefix.

    A GRPO group's ``n`` rows start with the same prompt ids (Prefix Grouper: Liu et al. 2025,
    "Efficient GRPO Training through Shared-Prefix Forward", arXiv:2506.05433). The prefix is the
    first ``L`` columns, ``L`` one less than the earliest sampled position of any row, so the rest
    runs as one right-padded batch over the prefix's keys/values (docs/architecture.md).

    Args:
        ids: ``[R, T]`` int64 token ids (right-padded rows).
        pids: ``[R, T]`` int64, >= 0 on sampled tokens (``Batch.param_ids``).
        min_saving: the fraction of the ``R * T`` token positions the sharing must save
            (``(R - G) * L``, ``G`` distinct prefixes).

    Returns:
        ``(L, prefixes [G, L] int64, row_prefix [R] int64)`` (row ``r``'s prefix is
        ``prefixes[row_prefix[r]]``), or None when no prefix is shared enough or no row samples.
    """
    R, T = ids.shape
    sampled = pids >= 0
    if not bool(sampled.any()):  # no logits to compute: nothing after a prefix to run
        return None
    first = torch.where(sampled.any(1), sampled.int().argmax(1), torch.full((R,), T + 1))
    L = int(first.min()) - 1
    if L < 1 or R < 2:
        return None
    prefixes, row_prefix = torch.unique(ids[:, :L], dim=0, return_inverse=True)
    if (R - prefixes.shape[0]) * L < min_saving * R * T:
        return None
    return L, prefixes, row_prefix


#: models that run in full: a prefix forward's cache is not keys/values alone (:func:`_kv_cache`),
#: or the rotary factors depend on a forward's longest position (:func:`_shares`)
_NO_SHARE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _shares(model: torch.nn.Module) -> bool:
    """Whether ``model``'s shared-prefix forward is its full forward (not with length-dependent rotary
    factors or a non-key/value cache); once false, false for that model object (warned once)."""
    if model in _NO_SHARE:
        return False
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    why = length_dependent_rope(getattr(inner, "config", None))
    if why:
        _NO_SHARE.add(model)
        _log.warning("trainer.shared_prefix: %s: %s; its forwards run in full", type(model).__name__, why)
    return not why


def _positions(model: torch.nn.Module, start: int, stop: int, rows: int, device: Any) -> dict[str, torch.Tensor]:
    """``{"position_ids": [rows, stop - start] int64}`` for a model that takes them, else ``{}``:
    explicit, since a Qwen2-VL-family model otherwise derives them from its last call's ``rope_deltas``."""
    if not accepts(model, "position_ids"):
        return {}
    return {"position_ids": torch.arange(start, stop, device=device).expand(rows, -1)}


def _kv_cache(cache: Any) -> bool:
    """Whether ``cache`` holds per-position keys/values alone (every layer a ``DynamicLayer`` or
    ``DynamicSlidingWindowLayer``), so selecting its rows gives each row its prefix's state."""
    from transformers import cache_utils

    kinds = tuple(getattr(cache_utils, n, None) for n in ("DynamicLayer", "DynamicSlidingWindowLayer"))
    layers = getattr(cache, "layers", None)
    return bool(layers) and hasattr(cache, "batch_select_indices") and all(type(x) in kinds for x in layers)


def _prefix_logits(model: torch.nn.Module, ids: torch.Tensor, plan: tuple[int, torch.Tensor, torch.Tensor],
                   kw: dict[str, Any], cache_kw: str) -> torch.Tensor | None:
    """Logits of ``ids[:, L:]`` after one forward of each distinct prefix, whose keys/values each
    row then reads (:func:`shared_prefix`); differentiable through both forwards. None (the caller
    runs in full, and this model never shares again) when the cache is not keys/values alone.

    Raises:
        RuntimeError: the key/value cache does not hold the prefix, or the model did not extend
            it by the suffix (e.g. a checkpointed layer dropping it).
    """
    L, prefixes, row_prefix = plan
    out = model(input_ids=prefixes.to(ids.device), use_cache=True, logits_to_keep=1,
                **_positions(model, 0, L, prefixes.shape[0], ids.device))
    cache = returned_cache(out)
    if not _kv_cache(cache):
        _NO_SHARE.add(model)
        _log.warning("trainer.shared_prefix: %s's cache (%s) is not keys/values alone; its forwards run in full",
                     type(model).__name__, type(cache).__name__)
        return None
    if cache.get_seq_length() != L:
        raise RuntimeError(f"internal: the prefix forward's KV cache holds {cache.get_seq_length()} positions, "
                           f"not the prefix's {L}; set trainer.shared_prefix = false and report this model")
    cache.batch_select_indices(row_prefix.to(ids.device))  # [G, ...] -> [R, ...], by index: grads sum back
    logits = model(input_ids=ids[:, L:], use_cache=True, **_positions(model, L, ids.shape[1], ids.shape[0], ids.device),
                   **kw, **{cache_kw: cache}).logits
    if cache.get_seq_length() != ids.shape[1]:
        raise RuntimeError("internal: the model did not read the shared prefix's KV cache; "
                           "set trainer.shared_prefix = false and report this model")
    return logits


def image_inputs(model: torch.nn.Module, vp: Any, rows: Sequence[tuple[Sequence[int], Sequence[bytes]]], width: int,
                 device: Any = None) -> dict[str, torch.Tensor]:
    """Image kwargs of a right-padded forward over ``rows`` (per row its ids and its images' bytes
    in token order): ``vp.padded_inputs`` (``position_ids`` ``[3, B, width]``, ``pixel_values``,
    ``image_grid_thw`` ``[N, 3]``); ``{}`` when no row has an image.

    Raises:
        ValueError: rows with images and no vision processor, or as ``vp.padded_inputs``.
    """
    if not any(imgs for _, imgs in rows):
        return {}
    if vp is None:
        raise ValueError("rows carry images but the model has no vision processor")
    return vp.padded_inputs(model, rows, width, device)


def forward_rows(trainer: Any, model: torch.nn.Module, batch: Batch, rows: slice,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) ``[b, T_rows]`` float32 of the sampled tokens of ``rows`` under
    ``model``, on ``trainer.device``. Right padding needs no attention mask (a causal model never
    attends to later positions); positions are explicit; logits are only computed at positions
    that predict a sampled token (``logits_to_keep``, when accepted). With ``trainer.shared_prefix``
    (not for images, routing records, ``lockstep`` or a model :func:`_shares` refuses) a shared
    prompt prefix runs once per distinct prefix: the same function up to float rounding.

    ``trainer`` (a :class:`~molt_core.train.trainer.Trainer`) gives the device, the routing replay
    context (``trainer._routing``), ``trainer.autocast``, ``lockstep`` (then a backward reaches every
    parameter) and ``trainer.vision_processor`` for ``batch.images``."""
    T = int(batch.lengths[rows].max())
    ids = batch.input_ids[rows, :T].to(trainer.device)
    pids = batch.param_ids[rows, :T]
    kw: dict[str, Any] = {}
    offset = 0
    plan = cache_kw = None
    if (getattr(trainer, "shared_prefix", False) and not trainer.lockstep and batch.images is None
            and batch.routed_experts is None and accepts(model, "logits_to_keep") and _shares(model)):
        cache_kw = cache_keyword(model)
        plan = shared_prefix(batch.input_ids[rows, :T], pids) if cache_kw else None
    if accepts(model, "logits_to_keep"):
        cols = (pids >= 0).any(0).nonzero().flatten()
        if cols.numel():
            offset = int(cols[0]) - 1
            kw["logits_to_keep"] = torch.arange(offset, int(cols[-1]), device=trainer.device)
    if batch.images is not None:  # a vision-language model: pixels, grids and 3D positions of the rows' images
        kw.update(image_inputs(model, getattr(trainer, "vision_processor", None),
                                [(r[:n].tolist(), im) for r, n, im in zip(ids, batch.lengths[rows].tolist(),
                                                                          batch.images[rows])], T, trainer.device))
    with trainer._routing(model, batch, rows, T), trainer.autocast():
        logits = None
        if plan:  # the logits of a shared-prefix forward start at column L
            shifted = {**kw, "logits_to_keep": kw["logits_to_keep"] - plan[0]}
            logits = _prefix_logits(model, ids, plan, shifted, cache_kw)
        shared = logits is not None  # (None: the model's cache cannot be shared, run in full)
        if logits is None:
            pos = {} if "position_ids" in kw else _positions(model, 0, T, ids.shape[0], ids.device)
            logits = model(input_ids=ids, use_cache=False, **pos, **kw).logits
    stats = getattr(trainer, "prefix_stats", None)  # the loss forwards' positions: [saved, total]
    if stats is not None and torch.is_grad_enabled():
        stats[0] += (ids.shape[0] - plan[1].shape[0]) * plan[0] if shared else 0
        stats[1] += ids.numel()
    lp, ent = token_logprobs(logits, ids, pids.to(trainer.device), batch.params, with_entropy, offset=offset)
    if trainer.lockstep and torch.is_grad_enabled():  # a backward reaches every parameter, even with no token
        lp = lp + 0.0 * torch.nan_to_num(logits[..., :1]).sum()  # (a NaN stays in its own row)
    return lp, ent


@torch.no_grad()
def recompute_logprobs(trainer: Any, batch: Batch, model: torch.nn.Module,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[B, T]`` float32 (CPU, 0 where not sampled) of the batch's sampled tokens under
    ``model`` in the update's micro-batches (``trainer._work``), and the entropy when asked."""
    lps = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    ents = torch.zeros(batch.input_ids.shape, dtype=torch.float32) if with_entropy else None
    for rows, real in trainer._work(batch, model):
        lp, ent = trainer._forward(model, batch, rows, with_entropy)
        if real:
            lps[rows, :lp.shape[1]] = lp.float().cpu()
            if ents is not None:
                ents[rows, :lp.shape[1]] = ent.cpu()
    return trainer._combine_rows(lps), (trainer._combine_rows(ents) if ents is not None else None)
