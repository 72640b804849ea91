"""Prefix cache for the embedded engine: the KV cache of finished generations, reused by the next
request whose prompt starts with the same ids (and images), so an agent's next turn prefills only its
tail. Exact-prefix matching by whole sequences, LRU eviction under ``budget_bytes``; the engine clears
it whenever weights change. Notes: docs/architecture.md.
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
        budget_bytes: most bytes of keys and values held (0 disables the cache).

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
        """Keep ``kv`` (per layer ``(keys, values)``, each ``[H, len(ids), D]``) for ``ids`` with image runs
        ``images``, evicting LRU entries beyond the budget (an empty or over-budget entry is not kept).
        Raises: ValueError when a tensor's length is not ``len(ids)``."""
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
        """The longest entry that is a prefix of ``prompt`` (at most ``len(prompt) - 1`` ids: the last position
        runs for its logits), cut back before the first image run of ``images`` it does not hold whole with
        the same image. Returns ``(n, kv)``, ``kv`` per layer ``[H, n, D]``, or ``(0, None)``."""
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
