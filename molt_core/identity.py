"""Token identity, measured at trainer ingress against the engine's own record.

The session ledger (:mod:`molt_core.ledger`) is the single place a trajectory is built from
engine ids. This module checks that independently of the ledger: every engine computes, where
its sampler emits ids, a digest of the ids it sampled in one generation
(:class:`IdDigest`, carried as ``GenerationOutput.sampled_digest``); the ledger stores it with
the sampled span it opens (``SampledSpan.digest``, next to ``SampledSpan.sampled_ids``, the ids
as the engine returned them); the trainer's ingress (:func:`screen`) recomputes the digest over
the segment's ``token_ids[start:end]`` and counts the action tokens whose id differs from what
the engine sampled (``invariants/tokens_retokenized``). A rollout with any such token is
refused: never trained on, counted in ``ingress/refused_rollouts``.

The digest is BLAKE2b (RFC 7693) with a 16-byte output over the ids as consecutive 8-byte
little-endian signed integers: ``blake2b(b"".join(i.to_bytes(8, "little", signed=True)
for i in ids), digest_size=16).hexdigest()`` (32 hex characters).

A sampled span without a digest (data written before this record existed, an engine that
does not produce one, or a record stripped on the way) cannot be checked: its action tokens
count in ``invariants/tokens_unverified``. By default (``trainer.refuse_unverified = true``)
such a rollout is refused like a mismatching one (``ingress/refused_unverified``): every
first-party engine records, so stripping the record cannot smuggle altered ids into training.
Set it to false to train on data from an engine that keeps no record (the tokens stay
counted).

What the digest guards against, and what not: it is an unkeyed hash, so it detects every
accidental change of sampled ids between the sampler and the trainer (re-tokenization, a
template or ledger bug, truncation, corruption in transit or on disk, a plugin editing
``token_ids``). It is not an authenticator: a party with write access to the trajectory that
rewrites ``token_ids``, ``sampled_ids`` and ``digest`` consistently is not detected (a keyed
MAC with a per-run secret shared only by engines and trainer would be needed for that; the
framework does not claim it).

Context tokens the ledger re-encoded from text when a chat template rewrote the history are
legitimate (they are never trained on) and are reported separately, summed from the
ledger-owned ``info["context_reencoded_tokens"]`` as ``ledger/context_reencoded_tokens``, and
each rewrite's cause (``info["rewrite_causes"]``) as ``ledger/rewrite_cause/<cause>``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from molt_core.types import Trajectory

__all__ = ["IdDigest", "TokenCheck", "check_tokens", "digest_ids", "screen"]

DIGEST_SIZE = 16


class IdDigest:
    """Incremental BLAKE2b-128 digest of a sequence of token ids (see the module doc).

    ``update`` takes ids (ints) in sampling order; ``hexdigest`` returns the 32-character hex
    digest of everything fed so far. Feeding ids one by one or all at once gives one digest.
    """

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
    """The BLAKE2b-128 hex digest of ``ids`` (see the module doc); ``digest_ids([])`` is
    ``"cae66941d9efbd404e4d88758ea67670"``."""
    return IdDigest().update(ids).hexdigest()


@dataclass(frozen=True)
class TokenCheck:
    """Result of :func:`check_tokens` for one trajectory (counts of action tokens).

    * ``retokenized`` -- action tokens whose id differs from the engine's record (when the
      stored ids are not the engine's either, every token of that span counts: which ones
      differ cannot be known).
    * ``unverified`` -- action tokens in no span carrying an engine digest.
    * ``first`` -- where the first mismatch is (``"segment j, span k"``), or None.
    """

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

    For each segment's sampled span with a ``digest``: the digest of ``token_ids[start:end]``
    must equal it; otherwise the differing positions are counted by comparing with
    ``sampled_ids`` (when their own digest is the engine's), else the whole span counts.
    Action tokens outside every digest-carrying span count as unverified.

    Args:
        traj: a trajectory (validated or built with ``model_construct``; spans past the end
            of the segment count as mismatching).

    Returns:
        A :class:`TokenCheck`.
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
    """Trainer ingress for token identity: refuse rollouts whose action tokens are not the
    engine's, and measure the step.

    Failed trajectories pass through untouched (the batch builder skips them). Each ``ok``
    one is checked with :func:`check_tokens`; one with a mismatching action token is
    dropped from the returned list (never trained on); with ``refuse_unverified`` so is one
    with an action token no engine record covers.

    Args:
        trajectories: the step's rollouts.
        refuse_unverified: refuse rollouts with unverified action tokens (the trainer passes
            ``trainer.refuse_unverified``, default true).

    Returns:
        ``(kept, metrics)``; ``metrics`` (floats): ``invariants/tokens_retokenized`` (action
        tokens whose id differs from the engine's record, summed over ok rollouts, 0 when
        clean), ``invariants/tokens_unverified`` (action tokens without an engine record),
        ``ingress/refused_retokenized`` and ``ingress/refused_unverified`` (rollouts dropped
        for each cause; a rollout with both counts as retokenized), ``ingress/refused_rollouts``
        (their sum), ``ledger/context_reencoded_tokens`` (sum of
        ``info["context_reencoded_tokens"]`` over ok rollouts) and ``ledger/rewrite_cause/<cause>``
        (rewrites per cause, summed from the ledger-owned ``info["rewrite_causes"]``, which lists
        every cause of :data:`molt_core.ledger.REWRITE_CAUSES`, 0 included).
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
