"""Typed core of molt-sdk: the Pydantic models every layer exchanges.

A rollout is a :class:`Trajectory`: one or more token-exact :class:`Segment` objects (more
than one when the agent rewrote its context, e.g. compaction), a reward and a status. A
:class:`Group` holds the ``n_samples_per_prompt`` trajectories of one prompt (the unit of a
baseline). ``Env.step`` / ``ChatAgent.run`` return a :class:`Result`.

Validators enforce the token-identity and policy-version alignment rules at the type level:
per-token lists have one length, a behaviour logprob and a policy version are present iff the
token was sampled (``loss_mask`` True), logprobs are finite and <= 0, and ``routed_experts``
(R3, arXiv 2510.11370) has one row per token. Every error names the field and the index.
"""

from __future__ import annotations

import math
import os
import random
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    field_validator,
    model_validator,
)

__all__ = [
    "PolicyVersion",
    "SamplingParams",
    "SampledSpan",
    "GenerationOutput",
    "ImageRef",
    "Segment",
    "Trajectory",
    "Group",
    "Result",
    "RewardFailed",
    "new_id",
]


class _IdSource:
    """128 random bits per id from a Mersenne Twister seeded with 256 bits of ``os.urandom``,
    reseeded in a forked child (so parent and child never share a stream): one
    ``os.urandom`` call per process instead of one per id -- ``uuid4`` releases the GIL for
    that syscall, which in a rollout worker hands the GIL to the engine thread for up to a
    switch interval, 64 times a step (issue 16 item 2). Ids only need to be unique; secrets
    (API keys) come from :mod:`secrets`."""

    def __init__(self) -> None:
        self.reseed()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.rng = random.Random(os.urandom(32))

    def hex(self) -> str:
        return f"{self.rng.getrandbits(128):032x}"


_IDS = _IdSource()


def new_id(prefix: str = "") -> str:
    """Return a fresh random hex id (32 lowercase hex chars, 128 random bits), optionally
    prefixed (``prefix-<hex>``). Unique, not secret (see :class:`_IdSource`)."""
    h = _IDS.hex()
    return f"{prefix}-{h}" if prefix else h


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class PolicyVersion(RootModel[int]):
    """Monotone integer stamped by the trainer at each weight publish (v0 = initial weights).

    Compare and order like an int; ``next()`` returns ``v + 1``.

    Raises:
        pydantic.ValidationError: if the value is negative.
    """

    root: int = Field(ge=0)

    def __int__(self) -> int:
        return self.root

    def __index__(self) -> int:
        return self.root

    def __lt__(self, other: PolicyVersion | int) -> bool:
        return self.root < int(other)

    def __le__(self, other: PolicyVersion | int) -> bool:
        return self.root <= int(other)

    def __gt__(self, other: PolicyVersion | int) -> bool:
        return self.root > int(other)

    def __ge__(self, other: PolicyVersion | int) -> bool:
        return self.root >= int(other)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PolicyVersion, int)):
            return self.root == int(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.root)

    def next(self) -> PolicyVersion:
        """The version published after one more optimizer step: ``v + 1``."""
        return PolicyVersion(self.root + 1)


class SamplingParams(_Strict):
    """Sampling settings of one generation request (engine and trainer share the transform).

    The behaviour distribution is ``softmax(logits / temperature)`` restricted to the top-k
    tokens and then to the smallest top-p nucleus, renormalised (the vLLM "processed
    logprobs" convention). ``temperature == 0`` means greedy; logprobs are then reported
    under the untempered, unfiltered distribution.

    Fields: ``temperature`` (>= 0), ``top_p`` in (0, 1], ``top_k`` (<= 0 disables),
    ``max_tokens`` (>= 1, new tokens per request), ``stop`` (strings), ``stop_token_ids``,
    ``seed`` (per-request RNG seed or None).
    """

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_tokens: int = Field(256, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None


class SampledSpan(_Strict):
    """A run ``[start, end)`` of sampled tokens in a segment and the transform they came from.

    The trainer recomputes logprobs of tokens in the span with exactly this temperature /
    top-k / top-p (forward consistency, and B09: renormalised top-k logprobs on both sides).

    The engine's record of what it sampled (token identity, :mod:`molt_core.identity`):
    ``digest`` -- the engine's BLAKE2b-128 hex digest of the ids it sampled in this span
    (``GenerationOutput.sampled_digest``); ``sampled_ids`` -- those ids as the engine returned
    them (``end - start`` ints), used to count which tokens differ. Both None on data written
    before the record existed (loads; ingress counts its tokens as unverified).

    Raises:
        pydantic.ValidationError: ``end < start``, or ``sampled_ids`` not of length ``end - start``.
    """

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    sampled_ids: list[int] | None = None
    digest: str | None = None

    @model_validator(mode="after")
    def _ordered(self) -> SampledSpan:
        if self.end < self.start:
            raise ValueError(f"sampled span end {self.end} < start {self.start}")
        if self.sampled_ids is not None and len(self.sampled_ids) != self.end - self.start:
            raise ValueError(
                f"sampled_ids has {len(self.sampled_ids)} ids but the span [{self.start}, {self.end}) holds "
                f"{self.end - self.start} tokens; the engine's record has one id per sampled token"
            )
        return self


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class GenerationOutput(BaseModel):
    """One generation's result.

    Fields (``N`` = number of sampled tokens):
      * ``token_ids`` ``[N]`` ints, exactly as sampled (a stop token, if hit, is included).
      * ``logprobs`` ``[N]`` floats, behaviour logprob of each sampled token (natural log).
      * ``versions`` ``[N]`` ints, policy version of the weights that sampled each token.
      * ``finish_reason``: ``stop`` (stop token or stop string) or ``length`` (max_tokens),
        ``abort`` (cancelled).
      * ``stop_reason``: the stop token id or stop string that ended it, or None.
      * ``routed_experts``: ``[P + N, num_moe_layers, top_k]`` for MoE engines (prompt
        positions included), else None.
      * ``prompt_len``: ``P``, the number of prompt ids the engine saw.
      * ``sampled_digest``: the engine's record of what it sampled -- the BLAKE2b-128 hex
        digest of ``token_ids`` computed where its sampler emitted them
        (:class:`molt_core.identity.IdDigest`); checked per action token at trainer ingress.
        None from an engine that keeps no record (its tokens then count as unverified).

    Raises:
        pydantic.ValidationError: if per-token lengths differ.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: int | str | None = None
    routed_experts: list[list[list[int]]] | None = None
    prompt_len: int = Field(0, ge=0)
    sampled_digest: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> GenerationOutput:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"token_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have one entry per sampled token"
            )
        return self


class ImageRef(_Strict):
    """One image a segment shows the model, and where its placeholder tokens sit.

    A vision-language processor (Qwen2-VL family) expands each image into a run of image
    placeholder tokens; ``token_ids[start:end]`` is that run, id for id as the engine saw it,
    so the trainer recomputes logprobs over exactly the image tokens the engine conditioned on.

    Fields:
      * ``sha256`` -- hex SHA-256 of the image's encoded bytes; the key into
        :attr:`Trajectory.images`, where the bytes are stored once per rollout.
      * ``start``, ``end`` -- token positions ``[start, end)`` of the placeholder run.
      * ``grid_thw`` -- ``[t, h, w]`` patch grid the image processor produced (ints); the run
        length is ``t * h * w // merge_size**2``.

    Raises:
        pydantic.ValidationError: a malformed digest, ``end <= start`` or a grid not of 3 ints >= 1.
    """

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    start: int = Field(ge=0)
    end: int = Field(ge=1)
    grid_thw: list[int] = Field(min_length=3, max_length=3)

    @model_validator(mode="after")
    def _ordered(self) -> ImageRef:
        if self.end <= self.start:
            raise ValueError(f"end = {self.end} must exceed start = {self.start}")
        if any(g < 1 for g in self.grid_thw):
            raise ValueError(f"grid_thw = {self.grid_thw} must be 3 ints >= 1")
        return self


class Segment(_Strict):
    """One token-exact sequence the engine saw and produced.

    Per-token fields (all of length ``T``):
      * ``token_ids`` -- int ids, prompt/template tokens and sampled tokens in order.
      * ``loss_mask`` -- True exactly on tokens the engine sampled.
      * ``logprobs`` -- behaviour logprob (natural log, <= 0, finite) iff sampled, else None.
      * ``versions`` -- policy version that sampled the token iff sampled, else None.
    Optional:
      * ``routed_experts`` -- ``[T, num_moe_layers, top_k]`` int expert ids, -1 where none (R3).
      * ``spans`` -- sampled spans with their sampling transform (see :class:`SampledSpan`);
        optional for the model, but the trainer refuses a segment with sampled tokens and no
        span (it could not know the temperature / top-k / top-p that sampled them).
      * ``finish_reason`` -- of the last generation in the segment.
      * ``images`` -- the images the segment shows, in token order (:class:`ImageRef`); their
        bytes live in the trajectory's ``images`` store. Empty for text-only segments.

    Raises:
        pydantic.ValidationError: naming the field and index of the first misalignment.
    """

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float | None]
    versions: list[int | None]
    routed_experts: list[list[list[int]]] | None = None
    spans: list[SampledSpan] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    images: list[ImageRef] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> Segment:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            m = len(getattr(self, name))
            if m != n:
                raise ValueError(
                    f"{name} has length {m} but token_ids has length {n}; every per-token "
                    f"field must have one entry per token"
                )
        for i, tid in enumerate(self.token_ids):
            if tid < 0:
                raise ValueError(f"token_ids[{i}] = {tid} is negative")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.logprobs, self.versions)):
            if m:
                if lp is None:
                    raise ValueError(f"logprobs[{i}] is missing on a sampled token (loss_mask[{i}] is True)")
                if v is None:
                    raise ValueError(f"versions[{i}] is missing on a sampled token (loss_mask[{i}] is True)")
                if not math.isfinite(lp):
                    raise ValueError(f"logprobs[{i}] = {lp} is not finite")
                if lp > 0.0:
                    raise ValueError(f"logprobs[{i}] = {lp} is positive; a log-probability is <= 0")
                if v < 0:
                    raise ValueError(f"versions[{i}] = {v} is negative")
            else:
                if lp is not None:
                    raise ValueError(f"logprobs[{i}] is set on a non-sampled token (loss_mask[{i}] is False)")
                if v is not None:
                    raise ValueError(f"versions[{i}] is set on a non-sampled token (loss_mask[{i}] is False)")
        if self.routed_experts is not None:
            r = len(self.routed_experts)
            if r != n:
                raise ValueError(
                    f"routed_experts has first dimension {r} but token_ids has length {n}; "
                    f"expected [T, num_moe_layers, top_k]"
                )
            shape = None
            for i, row in enumerate(self.routed_experts):
                s = (len(row), tuple(len(layer) for layer in row))
                if shape is None:
                    shape = s
                elif s != shape:
                    raise ValueError(f"routed_experts[{i}] has shape {s}, expected {shape} like row 0")
        for j, sp in enumerate(self.spans):
            if sp.end > n:
                raise ValueError(f"spans[{j}].end = {sp.end} exceeds the token count {n}")
        prev_end = 0
        for j, im in enumerate(self.images):
            if im.end > n:
                raise ValueError(f"images[{j}].end = {im.end} exceeds the token count {n}")
            if im.start < prev_end:
                raise ValueError(f"images[{j}] starts at {im.start}, inside or before images[{j - 1}]; "
                                 f"images must be in token order and not overlap")
            if any(self.loss_mask[im.start:im.end]):
                raise ValueError(f"images[{j}] covers sampled tokens; image placeholders are never sampled")
            prev_end = im.end
        return self

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        """Number of sampled (trainable) tokens."""
        return sum(self.loss_mask)

    def oldest_version(self) -> int | None:
        """The smallest policy version among sampled tokens, or None if none was sampled."""
        vs = [v for v in self.versions if v is not None]
        return min(vs) if vs else None

    def span_params(self) -> list[SampledSpan]:
        """The sampled spans; when ``spans`` is empty, one T=1 span per contiguous sampled run
        (a convenience for building test data; trainer ingress requires explicit spans)."""
        if self.spans:
            return list(self.spans)
        out: list[SampledSpan] = []
        start = None
        for i, m in enumerate(list(self.loss_mask) + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                out.append(SampledSpan(start=start, end=i))
                start = None
        return out


class Trajectory(_Strict):
    """One rollout of an agent on one task.

    ``segments`` holds more than one segment when the agent rewrote its context; all share
    ``rollout_id`` and the one ``reward`` (group baselines count one reward per rollout).
    ``status`` is ``"failed"`` (with ``error``) when the agent or reward raised or timed
    out: such trajectories are excluded from training, never scored 0.
    ``images`` maps an image's hex SHA-256 to its encoded bytes (base64 text, PNG/JPEG/...):
    each image is stored once per rollout however many segments or turns show it.

    Raises:
        pydantic.ValidationError: ``failed`` without ``error``, a non-finite reward, or a
            segment image whose digest is missing from ``images``.
    """

    rollout_id: str = Field(default_factory=lambda: new_id("r"))
    group_id: str = ""
    segments: list[Segment] = Field(default_factory=list)
    reward: float | None = None
    score: float | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    status: Literal["ok", "failed"] = "ok"
    error: str | None = None
    truncated: bool = False
    task: dict[str, Any] = Field(default_factory=dict)
    images: dict[str, str] = Field(default_factory=dict)

    @field_validator("reward", "score")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _failed_has_error(self) -> Trajectory:
        if self.status == "failed" and not self.error:
            raise ValueError("status is 'failed' but error is empty; say why it failed")
        for i, seg in enumerate(self.segments):
            for j, im in enumerate(seg.images):
                if im.sha256 not in self.images:
                    raise ValueError(f"segments[{i}].images[{j}].sha256 = {im.sha256[:12]}... is not in "
                                     f"images; store each image's bytes once in Trajectory.images")
        return self

    @property
    def num_sampled(self) -> int:
        """Total sampled tokens over all segments."""
        return sum(s.num_sampled for s in self.segments)

    def fail(self, error: str) -> Trajectory:
        """Return a copy marked failed with ``error`` (reward cleared)."""
        return self.model_copy(update={"status": "failed", "error": error, "reward": None})


class Group(_Strict):
    """The ``n_samples_per_prompt`` trajectories of one prompt: the unit of a baseline."""

    group_id: str = Field(default_factory=lambda: new_id("g"))
    task: dict[str, Any] = Field(default_factory=dict)
    trajectories: list[Trajectory] = Field(default_factory=list)

    def usable(self) -> list[Trajectory]:
        """Trajectories with status ``ok`` and a reward."""
        return [t for t in self.trajectories if t.status == "ok" and t.reward is not None]


class RewardFailed(RuntimeError):
    """A reward (or an env's scorer) could not produce a score: the trajectory is marked
    ``failed`` with ``str(exc)`` -- never scored 0.0.

    ``reason`` is a short machine-readable cause (``timeout``, ``memory``, ``crash``,
    ``parse``, ...); ``detail`` says what happened. ``str(exc)`` is ``"failed: <reason>"``
    followed by ``" (<detail>)"`` when there is a detail.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"failed: {reason}" + (f" ({detail})" if detail else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Ray) with reason and detail intact
        return (RewardFailed, (self.reason, self.detail))


class Result(_Strict):
    """What ``Env.step`` or ``ChatAgent.run`` returns.

    ``reward`` (float, summed over turns by the Env runner), ``observation`` (the next user
    message the model sees: text, or a list of content parts -- ``{"type": "text", "text"}``
    and images from :func:`molt_plugins.vision.images.image_part` -- or None), ``terminated`` /
    ``truncated`` (Gymnasium semantics), ``info``, ``score`` (task metric, may differ from
    reward), ``sampling_params`` for the next turn.
    """

    reward: float = 0.0
    observation: str | list[dict[str, Any]] | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)
    score: float | None = None
    sampling_params: SamplingParams | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward must be finite, got {v}")
        return v
