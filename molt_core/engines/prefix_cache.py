"""Prefix cache for the embedded engine: the KV cache of finished generations, reused by the next
request whose prompt starts with the same ids.

An agent's turn ``t + 1`` sends its whole conversation again: the ledger extends turn ``t``'s
prompt by the sampled ids and the template's tail, so the new prompt starts with every id whose
keys and values the engine computed for turn ``t``. Keeping those (per layer ``[H, n, D]``)
lets the engine prefill only the tail -- the idea of vLLM's automatic prefix caching, here by
whole finished sequences with exact-prefix matching (no block hashing).

Entries are keyed by their token ids -- and, for a vision-language model, by the images under
their image-token runs: image tokens are one id for every image, so ids alone would let a prompt
reuse keys/values computed from another image. A match never ends inside an image run and
never covers a run whose image differs (it is cut back to before that run).
Entries are evicted least recently used beyond ``budget_bytes``.
They hold keys and values of one set of weights: the engine clears the cache whenever weights
change (a reused prefix computed under old weights would sample from neither version).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

#: an image's run in a sequence: ``(sha256 of its bytes, start, end)``
ImageRun = tuple[str, int, int]

__all__ = ["PrefixCache"]


class PrefixCache:
    """LRU store of ``(token ids, per-layer (keys, values))`` under a byte budget.

    Args:
        budget_bytes: most bytes of keys and values held (0 disables the cache: ``put`` keeps
            nothing and ``match`` finds nothing).

    Raises:
        ValueError: ``budget_bytes < 0``.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._entries: OrderedDict[int, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]], int,
                                              frozenset[ImageRun]]] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.hits = 0  # prompts that reused a prefix
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to the cache

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], images: Sequence[ImageRun] = ()) -> None:
        """Keep ``kv`` (per layer ``(keys, values)``, each ``[H, len(ids), D]``) for ``ids``, whose
        image runs are ``images``; evict the least recently used entries beyond the budget. An
        entry bigger than the whole budget, or an empty one, is not kept. Raises: ValueError when
        a tensor's length is not ``len(ids)``."""
        n = len(ids)
        for k, v in kv:
            if k.shape[-2] != n or v.shape[-2] != n:
                raise ValueError(f"prefix cache: keys/values of length {k.shape[-2]}/{v.shape[-2]} for {n} ids")
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if n == 0 or size > self.budget_bytes:
            return
        self._entries[self._next] = (list(ids), kv, size, frozenset(images))
        self._next += 1
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, (_, _, s, _) = self._entries.popitem(last=False)
            self.nbytes -= s

    def match(self, prompt: list[int], images: Sequence[ImageRun] = ()) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The longest entry whose ids are a prefix of ``prompt`` (at most ``len(prompt) - 1`` of
        them: the last prompt position is always run, for its logits), cut back to before the
        first of the prompt's image runs ``images`` (in token order) that it does not hold whole
        with the same image. Returns ``(n, kv)`` with ``kv`` per layer ``(keys, values)``
        ``[H, n, D]``, or ``(0, None)``. The entry becomes the most recently used."""
        best, best_n = None, 0
        limit = len(prompt) - 1
        for key, (ids, _, _, held) in self._entries.items():
            n = min(len(ids), limit)
            if n > best_n and ids[n - 1] == prompt[n - 1] and prompt[:n] == ids[:n]:
                for run in images:
                    if run[1] >= n:
                        break
                    if run[2] > n or run not in held:
                        n = run[1]
                        break
                if n > best_n:
                    best, best_n = key, n
        if best is None:
            return 0, None
        self._entries.move_to_end(best)
        kv = self._entries[best][1]
        if best_n < len(self._entries[best][0]):
            kv = [(k[:, :best_n], v[:, :best_n]) for k, v in kv]
        self.hits += 1
        self.reused_tokens += best_n
        return best_n, kv

    def clear(self) -> None:
        """Drop every entry (the weights changed)."""
        self._entries.clear()
        self.nbytes = 0
