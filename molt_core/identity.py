"""Token identity at trainer ingress: each engine digests the ids it samples (:class:`IdDigest`), the
ledger keeps the digest with the span, and :func:`screen` refuses a rollout whose action tokens
differ from it or, by default, carry none (what it guards: docs/architecture.md)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from molt_core.types import Trajectory

__all__ = ["IdDigest", "TokenCheck", "check_tokens", "digest_ids", "screen"]

DIGEST_SIZE = 16


class IdDigest:
    """Incremental BLAKE2b-128 (RFC 7693) digest of token ids as 8-byte little-endian signed ints:
    ``blake2b(b"".join(i.to_bytes(8, "little", signed=True) for i in ids), digest_size=16)``;
    feeding ids one by one or all at once gives one digest."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=DIGEST_SIZE)

    def update(self, ids: Iterable[int]) -> IdDigest:
        """Feed ``ids`` (ints in ``[-2**63, 2**63)``); returns ``self``.

        Raises:
            OverflowError: an id outside the int64 range.
        """
        self._h.update(np.asarray(list(ids), dtype="<i8").tobytes())
        return self

    def hexdigest(self) -> str:
        """The digest of the ids fed so far (32 lowercase hex characters)."""
        return self._h.hexdigest()


def digest_ids(ids: Iterable[int]) -> str:
    """:class:`IdDigest` of ``ids`` (``digest_ids([])`` is ``"cae66941d9efbd404e4d88758ea67670"``)."""
    return IdDigest().update(ids).hexdigest()


@dataclass(frozen=True)
class TokenCheck:
    """:func:`check_tokens`' counts of action tokens: ``retokenized`` (differing from the engine's
    record), ``unverified`` (in no span with a digest); ``first``: the first mismatch's place or None."""

    retokenized: int
    unverified: int
    first: str | None = None


def _span_mismatch(ids: Sequence[int], recorded: Sequence[int] | None, digest: str) -> int:
    """Action tokens of one span (segment ids ``ids``) that differ from the engine's record."""
    if digest_ids(ids) == digest:
        return 0
    if recorded is not None and len(recorded) == len(ids) and digest_ids(recorded) == digest:
        return sum(a != b for a, b in zip(ids, recorded))
    return max(len(ids), 1)


def check_tokens(traj: Trajectory) -> TokenCheck:
    """Check every action token (``loss_mask`` True) of ``traj`` against the engine's record.

    A span whose ``token_ids[start:end]`` miss its ``digest`` counts the positions differing from
    ``sampled_ids`` (when those match the digest), else the whole span.

    ``traj`` may be ``model_construct``-ed (a span past the segment's end mismatches); returns a
    :class:`TokenCheck`.
    """
    bad = unverified = 0
    first = None
    for j, seg in enumerate(traj.segments):
        n = len(seg.token_ids)
        covered = [False] * n
        for k, sp in enumerate(seg.spans):
            if sp.digest is None:
                continue
            lo, hi = max(0, sp.start), min(sp.end, n)
            miss = _span_mismatch(seg.token_ids[lo:hi], sp.sampled_ids, sp.digest)
            if hi - lo != sp.end - sp.start:
                miss = max(miss, sp.end - sp.start)
            if miss and first is None:
                first = f"segment {j}, span {k} (tokens {sp.start}..{sp.end})"
            bad += miss
            for i in range(lo, hi):
                covered[i] = True
        unverified += sum(1 for i, m in enumerate(seg.loss_mask[:n]) if m and not covered[i])
    return TokenCheck(bad, unverified, first)


def screen(trajectories: Sequence[Trajectory], refuse_unverified: bool = False
           ) -> tuple[list[Trajectory], dict[str, float]]:
    """Trainer ingress for token identity: refuse rollouts whose action tokens are not the engine's.

    Failed trajectories pass through; an ``ok`` one with a mismatching action token is dropped, and
    with ``refuse_unverified`` (``trainer.refuse_unverified``) one with an unverified token.

    Returns:
        ``(kept, metrics)``, float sums over ok rollouts: ``invariants/tokens_retokenized``,
        ``invariants/tokens_unverified``, ``ingress/refused_retokenized`` / ``_unverified``
        (rollouts dropped; both causes count as retokenized), ``ingress/refused_rollouts``,
        ``ledger/context_reencoded_tokens``, ``ledger/rewrite_cause/<cause>`` (from the ledger's ``info``).
    """
    kept: list[Trajectory] = []
    retok = unver = ref_retok = ref_unver = reenc = 0
    causes: dict[str, float] = {}
    for t in trajectories:
        if t.status != "ok":
            kept.append(t)
            continue
        c = check_tokens(t)
        retok += c.retokenized
        unver += c.unverified
        reenc += int(t.info.get("context_reencoded_tokens", 0) or 0)
        for cause, n in (t.info.get("rewrite_causes") or {}).items():
            key = f"ledger/rewrite_cause/{cause}"
            causes[key] = causes.get(key, 0.0) + float(n)
        if c.retokenized:
            ref_retok += 1
        elif c.unverified and refuse_unverified:
            ref_unver += 1
        else:
            kept.append(t)
    return kept, {"invariants/tokens_retokenized": float(retok), "invariants/tokens_unverified": float(unver),
                  "ingress/refused_retokenized": float(ref_retok), "ingress/refused_unverified": float(ref_unver),
                  "ingress/refused_rollouts": float(ref_retok + ref_unver),
                  "ledger/context_reencoded_tokens": float(reenc), **causes}
