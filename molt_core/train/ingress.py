"""Trainer ingress: finished rollouts -> one padded :class:`Batch` (rows are segments, each row
pointing at its rollout, each rollout at its group), re-checking what the
:class:`~molt_core.types.Segment` validators check plus what only the trainer knows. Token
identity against the engine's record is checked before this, by :func:`molt_core.identity.screen`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from molt_core.identity import screen
from molt_core.models import routing_tool
from molt_core.types import Trajectory

__all__ = ["Batch", "IngressError", "NonFiniteLogprobs", "admit", "build_batch", "nonfinite_check", "refuse_malformed"]

_log = logging.getLogger("molt.ingress")


class IngressError(ValueError):
    """A trajectory handed to the trainer is malformed (token identity would be violated).

    The message names the rollout, the segment index and the field. ``reason``: ``"no_span"`` (a
    sampled token in no span), ``"nonfinite"`` (its behaviour logprob not finite) or ``"malformed"``.
    """

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class NonFiniteLogprobs(RuntimeError):
    """A trainer recompute gave a NaN or ``+inf`` logprob on sampled tokens (``-inf`` is out of
    support, not this); the train step refuses those rollouts and redoes the step on the rest.

    Attributes:
        rollouts: the affected rollouts, sorted indices into the batch's ``rewards``.
        tokens: sampled tokens with a non-finite value.
        where: the computation that found them (e.g. ``"the proximal recompute"``).
    """

    def __init__(self, rollouts: list[int], tokens: int, where: str) -> None:
        super().__init__(f"{where} gave a non-finite logprob on {tokens} sampled token(s) of rollout(s) "
                         f"{rollouts} (batch indices): refused")
        self.rollouts, self.tokens, self.where = rollouts, tokens, where


def nonfinite_check(values: torch.Tensor, batch: Batch, where: str, rows: torch.Tensor | None = None) -> None:
    """Raise :class:`NonFiniteLogprobs` when a sampled token has a NaN or ``+inf`` value.

    Args:
        values: ``[B, T]`` float logprobs of the batch (sampled where ``batch.mask``), or, with
            ``rows`` ``[N]`` long (the batch row of each), ``[N]`` values of sampled tokens.
            ``-inf`` (out of the recomputed support) passes.
        batch: the step's batch (``mask``, ``rollout_index``). where: the computation, for the message.

    Raises:
        NonFiniteLogprobs: naming the rollouts (indices into ``batch.rewards``) and the count.
    """
    if rows is None:
        values, rows = values[batch.mask], batch.mask.nonzero()[:, 0]
    bad = torch.isnan(values) | (values == math.inf)
    if bool(bad.any()):
        raise NonFiniteLogprobs(sorted(set(batch.rollout_index[rows[bad]].tolist())), int(bad.sum()), where)


@dataclass
class Batch:
    """A padded training batch; rows are segments, ``B`` rows of ``T`` tokens (right-padded).

    Per-token tensors index *tokens* (token ``t``'s logprob comes from the logits at ``t - 1``):

    * ``input_ids`` ``[B, T]`` int64 -- token ids, ``pad_id`` past each row's length.
    * ``mask`` ``[B, T]`` bool -- True exactly on sampled tokens.
    * ``behaviour_logprobs`` ``[B, T]`` float32 -- the engine's logprob, 0 where not sampled.
    * ``versions`` ``[B, T]`` int64 -- policy version that sampled the token, -1 elsewhere.
    * ``param_ids`` ``[B, T]`` int64 -- index into ``params`` of each sampled token, -1 elsewhere.
    * ``params`` -- distinct ``(temperature, top_k, top_p)`` transforms.
    * ``lengths`` ``[B]`` int64 -- unpadded row lengths.
    * ``rollout_index`` ``[B]`` int64 -- row -> rollout (index into ``rewards``).
    * ``rewards`` ``[R]`` float32 -- one reward per rollout.
    * ``group_index`` ``[R]`` int64 -- rollout -> group (an empty ``group_id``: a group of its own).
    * ``teacher_logprobs`` ``[B, T]`` float32 or None -- from ``info["teacher_logprobs"]``.
    * ``routed_experts`` ``[B, T, L, K]`` int64 or None -- the engine's MoE expert selection per
      position (R3), -1 where unrecorded, collated by the routing tool; None if none is recorded.
    * ``images`` -- per row, the encoded bytes of the segment's images in token order (from
      ``Trajectory.images`` by each ``ImageRef``'s SHA-256); None if no segment has one.
    """

    input_ids: torch.Tensor
    mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
    param_ids: torch.Tensor
    params: list[tuple[float, int, float]]
    lengths: torch.Tensor
    rollout_index: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    teacher_logprobs: torch.Tensor | None
    routed_experts: torch.Tensor | None = None
    images: list[list[bytes]] | None = None

    @property
    def size(self) -> int:
        """Number of rows ``B``."""
        return int(self.input_ids.shape[0])


def build_batch(
    trajectories: Sequence[Trajectory],
    pad_id: int = 0,
    vocab_size: int | None = None,
    need_teacher: bool = False,
    vision: Any = None,
) -> Batch:
    """Collate usable trajectories into a padded :class:`Batch` (trainer ingress) and return it.

    Trajectories with ``status == "failed"`` are skipped (never scored 0); the rest must carry
    a reward. Re-checks the :class:`~molt_core.types.Segment` validators (objects may have been
    mutated or built with ``model_construct``), ids below ``vocab_size``, no sampled token at
    position 0, and every sampled token inside exactly one sampled span.

    Args:
        trajectories: finished rollouts. pad_id: id used for right padding.
        vocab_size: the model's vocabulary size; ids must be below it (None skips the check).
        need_teacher: require ``info["teacher_logprobs"]`` (on-policy distillation): one per-token
            list per segment, a float on each sampled token.
        vision: the model's image processor: each segment's image runs must match its ``images``
            and each image's grid the recorded ``grid_thw``. None skips those checks (the bytes
            are still checked against their digests).

    Raises:
        IngressError: no usable trajectory, a missing reward, a duplicate ``rollout_id``, a
            rollout without sampled tokens, misaligned per-token fields, an id out of range, a
            sampled token at position 0 or outside every span, conflicting overlapping spans,
            missing/misaligned teacher logprobs, image bytes missing, not base64 or not hashing to
            their key, or (with ``vision``) image runs or grids other than ``vision``'s.
    """
    usable = [t for t in trajectories if t.status == "ok"]
    if not usable:
        raise IngressError(
            f"no usable trajectory: all {len(trajectories)} are failed or the list is empty; "
            "the trainer needs at least one ok trajectory with a reward"
        )
    rows: list[tuple[int, Any, int]] = []  # (rollout idx, segment, segment idx)
    rewards: list[float] = []
    group_of: list[int] = []
    groups: dict[str, int] = {}
    seen: set[str] = set()
    for traj in usable:
        rid = traj.rollout_id
        if rid in seen:
            raise IngressError(f"rollout_id {rid!r} appears twice; each rollout is one Trajectory (its segments share it)")
        seen.add(rid)
        if traj.reward is None:
            raise IngressError(f"rollout {rid}: reward is None; score it (or mark it failed) before training")
        if not math.isfinite(traj.reward):
            raise IngressError(f"rollout {rid}: reward {traj.reward} is not finite")
        if not traj.segments:
            raise IngressError(f"rollout {rid}: no segments")
        if traj.num_sampled == 0:
            raise IngressError(f"rollout {rid}: no sampled token in any segment (loss_mask is all False); nothing to train on")
        r = len(rewards)
        rewards.append(float(traj.reward))
        if traj.group_id:
            group_of.append(groups.setdefault(traj.group_id, len(groups)))
        else:
            group_of.append(groups.setdefault(f"\0{rid}", len(groups)))
        for j, seg in enumerate(traj.segments):
            rows.append((r, seg, j))

    # flatten every per-token field once; check and pad vectorised
    B = len(rows)
    where = [f"rollout {usable[r].rollout_id}, segment {j}" for r, _, j in rows]
    flat_ids: list[int] = []
    flat_mask: list[bool] = []
    flat_lp: list[float] = []
    flat_v: list[int] = []
    lens: list[int] = []
    for b, (r, seg, j) in enumerate(rows):
        n = len(seg.token_ids)
        if n == 0:
            raise IngressError(f"{where[b]}: empty segment (no token_ids)")
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(seg, name)) != n:
                raise IngressError(f"{where[b]}: {name} has length {len(getattr(seg, name))}, token_ids has {n}")
        lens.append(n)
        flat_ids += seg.token_ids
        flat_mask += seg.loss_mask
        flat_lp += [math.nan if x is None else x for x in seg.logprobs]
        flat_v += [-1 if x is None else x for x in seg.versions]
    lengths = torch.tensor(lens, dtype=torch.long)
    T = max(lens)
    ids = torch.tensor(flat_ids, dtype=torch.long)
    m = torch.tensor(flat_mask, dtype=torch.bool)
    lp = torch.tensor(flat_lp, dtype=torch.float64)
    v = torch.tensor(flat_v, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(B), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(len(flat_ids)) - starts[row]

    def first_bad(bad: torch.Tensor) -> tuple[int, int, int] | None:
        if not bool(bad.any()):
            return None
        k = int(bad.nonzero()[0])
        return int(row[k]), int(pos[k]), k

    hi = vocab_size if vocab_size is not None else None
    bad = first_bad((ids < 0) | (ids >= hi) if hi is not None else ids < 0)
    if bad:
        b, i, k = bad
        raise IngressError(f"{where[b]}: token_ids[{i}] = {flat_ids[k]} is outside the vocabulary [0, {vocab_size})")
    bad = first_bad(m & (pos == 0))
    if bad:
        raise IngressError(f"{where[bad[0]]}: loss_mask[0] is True; the first token has no context and cannot have been sampled")
    bad = first_bad(m & ~torch.isfinite(lp))
    if bad and rows[bad[0]][1].logprobs[bad[1]] is not None:  # (a missing one is malformed, below)
        b, i, k = bad
        raise IngressError(
            f"{where[b]}: sampled token {i} has behaviour logprob {flat_lp[k]!r}; the engine sampled it, so its "
            "logprob must be finite -- a NaN / infinite logprob is the engine's fault (counted in "
            "invariants/nonfinite_logprobs; the rollout is refused)", reason="nonfinite")
    bad = first_bad((m & (~torch.isfinite(lp) | (lp > 0) | (v < 0))) | (~m & (~torch.isnan(lp) | (v != -1))))
    if bad:
        b, i, k = bad
        seg = rows[b][1]
        raise IngressError(
            f"{where[b]}: token {i} (loss_mask {flat_mask[k]}) has logprob {seg.logprobs[i]!r} and version "
            f"{seg.versions[i]!r}; a sampled token needs a finite logprob <= 0 and a version >= 0, "
            "a non-sampled token neither"
        )

    # sampling transform of each sampled token, from the spans (a plain-list pass: a span covers
    # a handful of tokens, where per-span tensor ops are slower)
    params: list[tuple[float, int, float]] = []
    pindex: dict[tuple[float, int, float], int] = {}
    pid_list = [-1] * len(flat_ids)
    for b, (r, seg, j) in enumerate(rows):
        off = int(starts[b])
        if not seg.spans and any(seg.loss_mask):
            raise IngressError(
                f"{where[b]}: sampled tokens but no sampled span (spans is empty); the trainer cannot know "
                "which temperature/top-k/top-p sampled them -- record SampledSpan(start, end, temperature, "
                "top_k, top_p) for every run of sampled tokens (the ledger does)", reason="no_span")
        for k, sp in enumerate(seg.spans):
            if sp.end > lens[b]:
                raise IngressError(f"{where[b]}: spans[{k}] ends at {sp.end} beyond the {lens[b]} tokens")
            if sp.start < 0 or sp.end < sp.start:
                raise IngressError(f"{where[b]}: spans[{k}] is [{sp.start}, {sp.end}); a span needs 0 <= start <= end")
            key = (float(sp.temperature), int(sp.top_k), float(sp.top_p))
            c = pindex.setdefault(key, len(params))
            if c == len(params):
                params.append(key)
            lo, hi_ = off + sp.start, off + sp.end
            if any(p != -1 and p != c for p, sampled in zip(pid_list[lo:hi_], flat_mask[lo:hi_]) if sampled):
                raise IngressError(f"{where[b]}: spans[{k}] overlaps another span with different sampling settings")
            for i in range(lo, hi_):
                if flat_mask[i]:
                    pid_list[i] = c
    pid = torch.tensor(pid_list, dtype=torch.long)
    bad = first_bad(m & (pid == -1))
    if bad:
        raise IngressError(
            f"{where[bad[0]]}: sampled token {bad[1]} lies in no sampled span; the trainer "
            "cannot know which temperature/top-k/top-p sampled it", reason="no_span")

    def pad(x: torch.Tensor, fill: float | int | bool, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((B, T), fill, dtype=dtype)
        out[row, pos] = x.to(dtype)
        return out

    input_ids = pad(ids, pad_id, torch.long)
    mask = pad(m, False, torch.bool)
    beh = pad(torch.nan_to_num(lp, nan=0.0), 0.0, torch.float32)
    versions = pad(v, -1, torch.long)
    param_ids = pad(pid, -1, torch.long)
    rollout_index = torch.tensor([r for r, _, _ in rows], dtype=torch.long)

    teacher = None
    if need_teacher:
        teacher = torch.zeros((B, T), dtype=torch.float32)
        for b, (r, seg, j) in enumerate(rows):
            traj = usable[r]
            n = lens[b]
            tl = traj.info.get("teacher_logprobs")
            if not isinstance(tl, list) or len(tl) != len(traj.segments) or len(tl[j]) != n:
                raise IngressError(
                    f"{where[b]}: info['teacher_logprobs'] must hold one per-token list per segment "
                    f"(length {n} here) for advantage 'on_policy_distill'"
                )
            for i, sampled in enumerate(seg.loss_mask):
                if not sampled:
                    continue
                x = tl[j][i]
                if x is None or not math.isfinite(x):
                    raise IngressError(f"{where[b]}: teacher logprob of sampled token {i} is {x!r}; expected a finite float")
                teacher[b, i] = float(x)

    routed_rows = [seg.routed_experts for _, seg, _ in rows]
    tool = routing_tool() if any(r is not None for r in routed_rows) else None  # MoE routing (R3)
    try:
        routed = tool.collate(routed_rows, T, where) if tool is not None else None
    except ValueError as e:
        raise IngressError(str(e)) from None
    images = _row_images(usable, rows, where, vision)
    return Batch(
        input_ids=input_ids,
        mask=mask,
        behaviour_logprobs=beh,
        versions=versions,
        param_ids=param_ids,
        params=params,
        lengths=lengths,
        rollout_index=rollout_index,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        group_index=torch.tensor(group_of, dtype=torch.long),
        teacher_logprobs=teacher,
        routed_experts=routed,
        images=images,
    )


def _row_images(usable: Sequence[Trajectory], rows: Sequence[tuple[int, Any, int]], where: Sequence[str],
                vision: Any) -> list[list[bytes]] | None:
    """Each row's image bytes in token order (None when no segment has images), checked: the
    bytes hash to their key and, with ``vision``, the ids hold exactly the recorded runs."""
    if not any(seg.images for _, seg, _ in rows):
        return None
    decoded: dict[tuple[int, str], bytes] = {}
    out: list[list[bytes]] = []
    for b, (r, seg, j) in enumerate(rows):
        traj = usable[r]
        imgs = []
        for ref in seg.images:
            key = (r, ref.sha256)
            if key not in decoded:
                b64 = traj.images.get(ref.sha256)
                if not isinstance(b64, str):
                    raise IngressError(f"rollout {traj.rollout_id}: images has no {ref.sha256[:12]}...; store each "
                                       "segment image's bytes in Trajectory.images")
                try:
                    data = base64.b64decode(b64, validate=True)
                except (binascii.Error, ValueError):
                    raise IngressError(f"rollout {traj.rollout_id}: images[{ref.sha256[:12]}...] is not base64") from None
                if hashlib.sha256(data).hexdigest() != ref.sha256:
                    raise IngressError(f"rollout {traj.rollout_id}: images[{ref.sha256[:12]}...] does not hash to its "
                                       "key; the stored bytes are not the image the segment records")
                decoded[key] = data
            imgs.append(decoded[key])
        if vision is not None:  # the runs where the refs say, each image's grid as the trainer's processor gives it
            try:
                vision.check_segment(seg.token_ids, seg.images, imgs)
            except ValueError as e:
                raise IngressError(f"{where[b]}: {e}") from None
        out.append(imgs)
    return out


def refuse_malformed(trajectories: Sequence[Trajectory], pad_id: int = 0, vocab_size: int | None = None,
                     need_teacher: bool = False, vision: Any = None) -> tuple[list[Trajectory], dict[str, float], list[str]]:
    """Refuse, one rollout at a time, the ``ok`` rollouts :func:`build_batch` would reject (each
    checked alone), and a second rollout with an already seen ``rollout_id``, so one malformed
    rollout costs only itself. Failed rollouts pass through untouched.

    Args:
        trajectories: the step's rollouts.
        pad_id, vocab_size, need_teacher, vision: as for :func:`build_batch`.

    Returns:
        ``(kept, metrics, reasons)``: the rollouts to train on (order kept); floats
        ``ingress/refused_malformed`` (rollouts refused), of those ``ingress/refused_no_span``
        (a sampled token in no span) and ``ingress/refused_nonfinite`` (a NaN / infinite
        behaviour logprob), and ``invariants/nonfinite_logprobs`` (such tokens); one message per
        refused rollout naming it, the segment and the field (also logged on ``molt.ingress``).
    """
    kept: list[Trajectory] = []
    reasons: list[str] = []
    seen: set[str] = set()
    no_span = nonfinite = nonfinite_tokens = 0
    for t in trajectories:
        if t.status != "ok":
            kept.append(t)
            continue
        try:
            if t.rollout_id in seen:
                raise IngressError(f"rollout_id {t.rollout_id!r} appears twice; each rollout is one Trajectory "
                                   "(its segments share it); the later one is refused")
            build_batch([t], pad_id, vocab_size, need_teacher, vision)
        except IngressError as e:
            msg = str(e)
            reasons.append(msg)
            no_span += e.reason == "no_span"
            if e.reason == "nonfinite":
                nonfinite += 1
                nonfinite_tokens += sum(m and x is not None and not math.isfinite(x)
                                        for seg in t.segments for m, x in zip(seg.loss_mask, seg.logprobs))
            _log.warning("ingress refused a rollout: %s", msg)
            continue
        seen.add(t.rollout_id)
        kept.append(t)
    return kept, {"ingress/refused_malformed": float(len(reasons)), "ingress/refused_no_span": float(no_span),
                  "ingress/refused_nonfinite": float(nonfinite),
                  "invariants/nonfinite_logprobs": float(nonfinite_tokens)}, reasons


def admit(trajectories: Sequence[Trajectory], pad_id: int, vocab_size: int | None, need_teacher: bool,
          refuse_unverified: bool, vision: Any = None) -> tuple[list[Trajectory], Batch | None, dict[str, float]]:
    """A train step's ingress: refuse malformed rollouts one at a time (:func:`refuse_malformed`;
    the whole batch first, so the clean case builds once), then rollouts whose action tokens
    differ from, or with ``refuse_unverified`` lack, the engine's record (:func:`molt_core.identity.screen`).

    Returns:
        ``(kept trajectories, their Batch or None when it must be rebuilt, metrics)``: those of
        ``screen`` and :func:`refuse_malformed`, ``ingress/refused_rollouts`` counting every refusal.
    """
    try:
        batch: Batch | None = build_batch(trajectories, pad_id, vocab_size, need_teacher=need_teacher, vision=vision)
        malformed = {"ingress/refused_malformed": 0.0, "ingress/refused_no_span": 0.0,
                     "ingress/refused_nonfinite": 0.0, "invariants/nonfinite_logprobs": 0.0}
    except IngressError:
        batch = None
        trajectories, malformed, _reasons = refuse_malformed(trajectories, pad_id, vocab_size, need_teacher=need_teacher,
                                                             vision=vision)
    n_in = len(trajectories)
    kept, ingress = screen(trajectories, refuse_unverified=refuse_unverified)
    if len(kept) != n_in:
        batch = None
    ingress.update(malformed)
    ingress["ingress/refused_rollouts"] += malformed["ingress/refused_malformed"]
    return kept, batch, ingress
