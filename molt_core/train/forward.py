"""Policy forwards: the logprob of each sampled token under its span's sampling transform.

:func:`token_logprobs` turns logits into those logprobs (:func:`molt_core.sampling.processed_logprobs`,
the transform the engine sampled with, so identical weights give a ratio of exactly 1);
:func:`forward_rows` runs one micro-batch of a :class:`~molt_core.train.ingress.Batch` through a
model; :func:`recompute_logprobs` a whole batch, no grad.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from molt_core.sampling import processed_logprobs
from molt_core.train.ingress import Batch

__all__ = ["forward_rows", "model_vocab", "recompute_logprobs", "token_logprobs"]


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
        logits: ``[B, K, V]`` model outputs for positions ``offset .. offset + K - 1``
            (logits at position ``t - 1`` predict token ``t``; ``K = T``, ``offset = 0`` for a
            full forward).
        input_ids: ``[B, T]`` int64 token ids.
        param_ids: ``[B, T]`` int64, index into ``params`` for sampled tokens, -1 elsewhere
            (position 0 must be -1).
        params: ``(temperature, top_k, top_p)`` per index, applied by
            :func:`molt_core.sampling.processed_logprobs` (temperature -> top-k -> top-p).
        with_entropy: also return the entropy (nats) of the processed distribution at each
            sampled position (computed without grad).

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


def forward_rows(trainer: Any, model: torch.nn.Module, batch: Batch, rows: slice,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) ``[b, T_rows]`` float32 of the sampled tokens of ``rows`` under
    ``model``, on ``trainer.device``; right padding needs no attention mask (a causal model
    never attends to later positions). Logits are only computed at the positions that
    predict a sampled token (``logits_to_keep`` as column indices, when the model accepts it).

    ``trainer`` (a :class:`~molt_core.train.trainer.Trainer`) gives the device, the routing
    replay context (``trainer._routing``) and ``lockstep`` (then a backward reaches every
    parameter, even with no sampled token)."""
    T = int(batch.lengths[rows].max())
    ids = batch.input_ids[rows, :T].to(trainer.device)
    pids = batch.param_ids[rows, :T]
    kw: dict[str, Any] = {}
    offset = 0
    if accepts(model, "logits_to_keep"):
        cols = (pids >= 0).any(0).nonzero().flatten()
        if cols.numel():
            offset = int(cols[0]) - 1
            kw["logits_to_keep"] = torch.arange(offset, int(cols[-1]), device=trainer.device)
    with trainer._routing(model, batch, rows, T):
        logits = model(input_ids=ids, use_cache=False, **kw).logits
    lp, ent = token_logprobs(logits, ids, pids.to(trainer.device), batch.params, with_entropy, offset=offset)
    if trainer.lockstep and torch.is_grad_enabled():  # a backward reaches every parameter, even with no token
        lp = lp + 0.0 * logits[..., :1].sum()
    return lp, ent


@torch.no_grad()
def recompute_logprobs(trainer: Any, batch: Batch, model: torch.nn.Module,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[B, T]`` float32 (CPU) of the batch's sampled tokens under ``model``, in the
    micro-batches ``trainer._work`` gives (the ones the update uses); 0 where not sampled.
    Also the entropy ``[B, T]`` when ``with_entropy``."""
    lps = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    ents = torch.zeros(batch.input_ids.shape, dtype=torch.float32) if with_entropy else None
    for rows, real in trainer._work(batch, model):
        lp, ent = trainer._forward(model, batch, rows, with_entropy)
        if real:
            lps[rows, :lp.shape[1]] = lp.float().cpu()
            if ents is not None:
                ents[rows, :lp.shape[1]] = ent.cpu()
    return trainer._combine_rows(lps), (trainer._combine_rows(ents) if ents is not None else None)
