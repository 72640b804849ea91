"""Forward consistency on every step, async included: recompute under the behaviour version.

``invariants/logprob_absdiff_max_onpolicy`` compares a token's behaviour logprob with the trainer's
*under the weights that sampled it*: the proximal logprobs for current-version tokens, else a recompute
under CPU copies of the last ``max_staleness`` versions (:class:`VersionHistory`; docs/architecture.md).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable

import torch

__all__ = ["ONPOLICY_ABSDIFF_TOL", "VersionHistory", "onpolicy_metrics", "sample_rows", "select_rows",
           "stale_absdiff", "storage_key"]

#: Documented bound (nats) of ``invariants/logprob_absdiff_max_onpolicy`` per compute dtype when
#: engine and trainer run the same weights: float32 rounding only; bfloat16 rounds a logit of ~10 by
#: ~0.04. A reading above it means engine and trainer disagree (measurements: docs/architecture.md).
ONPOLICY_ABSDIFF_TOL = {"float32": 1e-4, "bfloat16": 0.1}


def storage_key(t: torch.Tensor) -> tuple:
    """What makes two state-dict entries one tensor (tied weights: same device, storage
    address, dtype, shape, stride and offset) -- so a copy of a state dict holds it once."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


class VersionHistory:
    """CPU copies of the last ``keep`` policy versions' weights, and a shadow model to run them.

    Args:
        keep: how many versions to hold (``async.max_staleness``; 0 holds none).

    Attributes:
        shadow: the deep copy of the policy the weights are loaded into (built by :meth:`load`), or None.
    """

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"VersionHistory keep must be >= 0, got {keep}")
        self.keep = keep
        self._states: dict[int, dict[str, torch.Tensor]] = {}
        self.shadow: torch.nn.Module | None = None
        #: with :meth:`share`: ``keep + 1`` shared-memory state dicts the copies are written into
        self.ring: list[dict[str, torch.Tensor]] | None = None
        self._slot: dict[int, int] = {}  # held version -> its ring slot

    def record(self, version: int, model: torch.nn.Module) -> None:
        """Copy ``model``'s weights (CPU) as policy ``version``; keep only the newest ``keep``.

        Call it with the weights the engines received as ``version``: in the trainer, just before
        the optimizer step that turns them into ``version + 1``. Tied entries are copied once.
        """
        if self.keep == 0:
            return
        if self.ring is not None:  # into the slot no held version uses (one check in flight reads the others)
            free = min(set(range(len(self.ring))) - {self._slot[v] for v in self._states})
            dst = self.ring[free]
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    dst[k].copy_(v.detach())  # tied entries share a slot tensor: copied twice, same bytes
            self._states[version], self._slot[version] = dst, free
            for old in sorted(self._states)[:-self.keep]:
                del self._states[old], self._slot[old]
            return
        copies: dict[tuple, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for k, v in model.state_dict().items():
            v = v.detach()
            key = storage_key(v)
            if key not in copies:
                copies[key] = v.to("cpu", copy=True)
            state[k] = copies[key]
        self._states[version] = state
        for old in sorted(self._states)[:-self.keep]:
            del self._states[old]

    def share(self, ring: list[dict[str, torch.Tensor]]) -> None:
        """From now on keep the copies in ``ring``: ``keep + 1`` state dicts whose tensors another
        process maps too (:class:`molt_core.train.onpolicy_check.CheckProcess`); :meth:`slots` says
        which slot holds which version. :meth:`record` writes into the slot no held version uses, so
        a reader of the held versions is safe until the next :meth:`record`. Held versions are copied in.

        Raises:
            ValueError: ``ring`` does not have ``keep + 1`` slots (``keep`` 0 holds nothing).
        """
        if self.keep == 0 or len(ring) != self.keep + 1:
            raise ValueError(f"VersionHistory.share: a ring of keep + 1 = {self.keep + 1} slots is needed "
                             f"(got {len(ring)}; keep 0 holds nothing)")
        held, self._slot = self._states, {}
        self.ring, self._states = ring, {}
        for i, v in enumerate(sorted(held)):
            with torch.no_grad():
                for k, t in held[v].items():
                    ring[i][k].copy_(t)
            self._states[v], self._slot[v] = ring[i], i

    def slots(self) -> dict[int, int]:
        """Held version -> its ring slot (after :meth:`share`; else empty)."""
        return dict(self._slot)

    def nbytes(self) -> int:
        """Host bytes held by the copies of every held version (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for st in self._states.values():
            for v in st.values():
                seen[id(v)] = v.numel() * v.element_size()
        return sum(seen.values())

    def versions(self) -> list[int]:
        """Versions held, oldest first."""
        return sorted(self._states)

    def clear(self) -> None:
        """Forget every version (e.g. after loading a checkpoint: the engines' versions differ)."""
        self._states.clear()
        self._slot.clear()

    def load(self, version: int, like: torch.nn.Module) -> torch.nn.Module:
        """The shadow model holding ``version``'s weights (built from ``like`` on first use).

        Raises:
            KeyError: ``version`` is not held.
        """
        if version not in self._states:
            raise KeyError(f"policy version {version} is not held (held: {self.versions()})")
        if self.shadow is None:
            self.shadow = copy.deepcopy(like).eval().requires_grad_(False)
        self.shadow.load_state_dict(self._states[version])
        return self.shadow


def select_rows(batch, rows: torch.Tensor):
    """The :class:`~molt_core.train.Batch` restricted to ``rows`` (``[N]`` long); rewards, groups kept whole."""
    per_row = {f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)
               if f.name in ("input_ids", "mask", "behaviour_logprobs", "versions", "param_ids", "lengths",
                             "rollout_index", "teacher_logprobs", "routed_experts")
               and getattr(batch, f.name) is not None}
    if getattr(batch, "images", None) is not None:  # per-row lists of image bytes
        per_row["images"] = [batch.images[i] for i in rows.tolist()]
    return dataclasses.replace(batch, **per_row)


def sample_rows(idx: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """At most ``n`` entries of ``idx`` (``[M]`` long): all when ``n < 0`` or ``M <= n``, else ``n``
    drawn uniformly without replacement with ``generator``, in ``idx``'s order."""
    if n < 0 or idx.numel() <= n:
        return idx
    pick = torch.randperm(idx.numel(), generator=generator)[:n].sort().values
    return idx[pick]


def stale_absdiff(batch, current_version: int, history: VersionHistory,
                  recompute: Callable[[object, torch.nn.Module], torch.Tensor], like: torch.nn.Module,
                  max_rows: int = -1, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``|behaviour - logprob under the behaviour version|`` of sampled tokens that an *older*
    version sampled, for every older version ``history`` holds.

    Args:
        batch: the step's :class:`~molt_core.train.Batch` (``mask``, ``versions``, ``behaviour_logprobs``).
        current_version: the trainer's version (its tokens use the proximal logprobs instead).
        history: weights of older versions. like: the policy (template for the shadow model).
        recompute: ``recompute(sub_batch, model) -> [N, T] float32`` logprobs of the sampled
            tokens of ``sub_batch`` under ``model`` (the trainer's ``recompute_logprobs``).
        max_rows: rows recomputed per older version (< 0: all; 0: none; n > 0: a uniform sample,
            :func:`sample_rows`, drawn with ``generator``).

    Returns:
        ``(diffs, rows)``: ``[N]`` float64 absolute differences in nats (``inf`` for a token
        outside the support its own version recomputes, NaN where the recompute is NaN or
        ``+inf``: :func:`onpolicy_metrics`) and ``[N]`` long, the batch row of each.
    """
    mask, ver = batch.mask, batch.versions
    out = [torch.zeros(0, dtype=torch.float64)]
    at = [torch.zeros(0, dtype=torch.long)]
    if max_rows == 0:
        return out[0], at[0]
    for v in history.versions():
        if v >= current_version:
            continue
        tok = mask & (ver == v)
        rows = sample_rows(tok.any(-1).nonzero().flatten(), max_rows, generator)
        if rows.numel() == 0:
            continue
        sub = select_rows(batch, rows)
        lp = recompute(sub, history.load(v, like))
        d = torch.where(lp == math.inf, math.nan, (sub.behaviour_logprobs - lp).abs())
        out.append(d[tok[rows]].double())
        at.append(rows[:, None].expand(-1, tok.shape[1])[tok[rows]])
    return torch.cat(out), torch.cat(at)


def onpolicy_metrics(current: torch.Tensor, stale: torch.Tensor) -> dict[str, float]:
    """Forward-consistency metrics from the absolute logprob differences (nats) of tokens
    measured under the version that sampled them.

    Args:
        current: ``[N1]`` float, current-version tokens (behaviour vs proximal).
        stale: ``[N2]`` float, tokens of older versions (:func:`stale_absdiff`).

    An infinite difference (a token outside its own version's top-k / top-p support) is counted
    in ``invariants/onpolicy_out_of_support_tokens``, not in the max and mean. A NaN one (a NaN or
    ``+inf`` recompute) is an error: the trainer refuses such rollouts first (``nonfinite_check``).

    Raises:
        ValueError: a NaN in ``current`` or ``stale``.

    Returns:
        ``invariants/logprob_absdiff_max_onpolicy`` and ``_mean_onpolicy`` over the finite
        differences (NaN when no token could be measured, e.g. the first step after a resume),
        ``invariants/onpolicy_out_of_support_tokens``, ``invariants/onpolicy_tokens`` (measured,
        out-of-support included), ``invariants/onpolicy_stale_tokens`` (of those, older versions).
    """
    d = torch.cat([current.double().flatten(), stale.double().flatten()])
    if bool(torch.isnan(d).any()):
        raise ValueError(f"onpolicy_metrics: {int(torch.isnan(d).sum())} NaN logprob difference(s) (a NaN or +inf "
                         "recompute); refuse their rollouts first (molt_core.train.ingress.nonfinite_check) -- a NaN "
                         "is not out of support")
    n = d.numel()
    fin = d[torch.isfinite(d)]
    return {
        "invariants/logprob_absdiff_max_onpolicy": float(fin.max()) if fin.numel() else math.nan,
        "invariants/logprob_absdiff_mean_onpolicy": float(fin.mean()) if fin.numel() else math.nan,
        "invariants/onpolicy_out_of_support_tokens": float(n - fin.numel()),
        "invariants/onpolicy_tokens": float(n),
        "invariants/onpolicy_stale_tokens": float(stale.numel()),
    }
