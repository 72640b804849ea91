"""The transformers engine's batch rows: a request in flight (:class:`_Request`) and the
helpers that left-pad, merge and rebuild the running batch's plain ``DynamicCache``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from molt_core.identity import IdDigest
from molt_core.types import SamplingParams

__all__ = ["_Request", "_default_eos_ids", "_layers", "_lpad", "_past_cache"]


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    next_pos: int = 0  # real tokens already in this row's KV cache
    routed: list[torch.Tensor] = field(default_factory=list)  # [n_i, L, K] chunks, by position
    digest: IdDigest = field(default_factory=IdDigest)  # the record of sampled ids (token identity)
    vision: Any = None  # the prompt's images (the modality's row_images; vision-language models)

    @property
    def key(self) -> tuple:
        """What makes two prompts the same forward: ids, and the images under their image runs."""
        return (tuple(self.prompt_ids), self.vision.shas if self.vision is not None else ())

    @property
    def rope_delta(self) -> int:
        """Position offset of tokens after the prompt (M-RoPE image runs span fewer positions); 0 for text."""
        return self.vision.delta if self.vision is not None else 0


def _default_eos_ids(tokenizer: Any) -> list[int]:
    ids = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for s in ("<|im_end|>", "<|endoftext|>"):
        if s in vocab:
            ids.add(int(vocab[s]))
    return sorted(ids)


def _layers(cache: Any) -> list[Any]:
    layers = list(getattr(cache, "layers", []))
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"TransformersEngine batches plain DynamicLayer KV caches; this model uses {type(layer).__name__}"
            )
    return layers


def _past_cache(hits: list[tuple[int, Any]], past: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """A ``DynamicCache`` of ``len(hits)`` rows, ``past`` columns, each hit's ``(m, kv)`` right-aligned, and
    its ``[B, past]`` int64 mask (1 on reused columns)."""
    from transformers import DynamicCache  # loaded lazily (start-up time)

    ref = next(kv for m, kv in hits if m)
    pmask = torch.zeros(len(hits), past, dtype=torch.long, device=device)
    data = []
    for li, (k0, v0) in enumerate(ref):
        k = k0.new_zeros(len(hits), k0.shape[0], past, k0.shape[2])
        v = v0.new_zeros(len(hits), v0.shape[0], past, v0.shape[2])
        for i, (m, kv) in enumerate(hits):
            if m:
                k[i, :, past - m:] = kv[li][0]
                v[i, :, past - m:] = kv[li][1]
        data.append((k, v))
    for i, (m, _) in enumerate(hits):
        if m:
            pmask[i, past - m:] = 1
    return DynamicCache(ddp_cache_data=data), pmask


def _lpad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Left-pad ``t`` with zeros along ``dim`` (-1 or -2) to ``length``."""
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    pad = (extra, 0) if dim == -1 else (0, 0, extra, 0)
    return F.pad(t, pad)
