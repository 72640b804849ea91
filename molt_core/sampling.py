"""The sampling transform shared by every engine and the trainer (forward consistency): behaviour
logprobs are those of the distribution actually sampled from, so with identical weights the
importance ratio is exactly 1 (B08, B09)."""

from __future__ import annotations

import torch

__all__ = ["BATCHED_DRAW_MAX_VOCAB", "draw_tokens", "processed_logits", "processed_logprobs"]


def processed_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p to ``logits`` (renormalised; filtered entries -inf).

    Args:
        logits: ``[..., V]`` float tensor (any float dtype; computed in float32).
        temperature: > 0 divides the logits; 0 means greedy (no scaling, no filtering).
        top_k: keep the ``top_k`` largest logits (<= 0 or >= V disables).
        top_p: keep the smallest set of tokens whose probability mass reaches ``top_p``
            (the top token is always kept); 1.0 disables.

    Returns:
        ``[..., V]`` float32 tensor of processed logits.

    Source: Holtzman et al. 2019 (nucleus sampling, arXiv 1904.09751); vLLM's sampler order.
    """
    x = logits.float()
    if temperature == 0:
        return x
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = probs.cumsum(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (cum - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """``log_softmax`` of :func:`processed_logits`: ``[..., V]`` float32, -inf where filtered.

    Example (B08): logits ``[2, 1, 0]``, T=0.5 -> logprob of token 0 is -0.142932.
    """
    return torch.log_softmax(processed_logits(logits, temperature, top_k, top_p), dim=-1)


#: above this vocabulary size :func:`draw_tokens` samples row by row (a [rows, V] division leaves cache)
BATCHED_DRAW_MAX_VOCAB = 8192


def draw_tokens(logprobs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row, row ``j`` drawn from ``exp(logprobs[j])`` with ``generators[j]``.

    The token ``torch.multinomial(p[j], 1, generator=generators[j])`` gives, as one batched
    ``argmax(p / E)``, ``E ~ Exp(1)`` from each row's generator (the exponential race: Gumbel 1954;
    Vieira 2014); per-row multinomial above :data:`BATCHED_DRAW_MAX_VOCAB` or for a bad row.

    Args:
        logprobs: ``[B, V]`` float32 log-probabilities (``-inf`` for filtered tokens).
        generators: ``B`` generators (``None``: torch's default generator), one per row.

    Returns:
        ``[B]`` int64 token ids.

    Raises:
        RuntimeError: a row is not a valid distribution (from ``torch.multinomial``).
    """
    p = logprobs.exp()
    rows = p.shape[0]
    if rows == 0:
        return torch.zeros(0, dtype=torch.long, device=p.device)
    if p.shape[-1] > BATCHED_DRAW_MAX_VOCAB or not bool(torch.isfinite(p).all()) or bool((p.sum(-1) <= 0).any()):
        return torch.cat([torch.multinomial(p[j], 1, generator=generators[j]) for j in range(rows)])
    q = torch.empty_like(p)
    for j in range(rows):
        q[j].exponential_(generator=generators[j])
    return torch.div(p, q, out=q).argmax(-1)
