"""The Pydantic models every layer exchanges: a :class:`Trajectory` of token-exact :class:`Segment`
objects, the :class:`Group` of one prompt, an engine's :class:`GenerationOutput`, an agent's
:class:`Result`. Validators refuse misaligned per-token fields, naming the field and the index."""

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
    """128-bit ids from a Mersenne Twister seeded from ``os.urandom`` (reseeded after a fork)."""

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
    """A fresh id: 32 lowercase hex chars (128 random bits), as ``prefix-<hex>`` with a prefix. Not secret."""
    h = _IDS.hex()
    return f"{prefix}-{h}" if prefix else h


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class PolicyVersion(RootModel[int]):
    """Monotone integer stamped by the trainer at each weight publish (v0: initial weights); orders like an int.

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

    Fields: ``temperature`` (>= 0; 0: greedy), ``top_p`` in (0, 1], ``top_k`` (<= 0 disables),
    ``max_tokens`` (>= 1, new tokens per request), ``stop`` (strings), ``stop_token_ids``, ``seed``
    (per-request RNG seed or None); the transform: :mod:`molt_core.sampling`.
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

    The trainer recomputes its logprobs with exactly this transform (B09). The engine's record
    (:mod:`molt_core.identity`): ``digest`` and ``sampled_ids`` (``end - start`` ints), or None.

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
    """One generation's result: ``N`` sampled tokens after ``P = prompt_len`` prompt ids.

      * ``token_ids`` ``[N]`` ints exactly as sampled (a hit stop token included); ``logprobs``
        ``[N]`` behaviour logprobs (natural log); ``versions`` ``[N]`` policy versions that sampled them.
      * ``finish_reason``: ``stop`` (stop token or string), ``length`` (max_tokens), ``abort``;
        ``stop_reason``: the stop token id or string that ended it, or None.
      * ``routed_experts``: ``[P + N, num_moe_layers, top_k]`` for MoE engines, else None.
      * ``sampled_digest``: :class:`molt_core.identity.IdDigest` of ``token_ids`` where the sampler
        emitted them, checked at trainer ingress; None from an engine that keeps no record.

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

    Fields: ``sha256`` (hex, the key into :attr:`Trajectory.images`); ``[start, end)``, the run of
    placeholder tokens it expands into; ``grid_thw``, the ``[t, h, w]`` patch grid (run length
    ``t * h * w // merge_size**2``).

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

    Per-token fields (length ``T``): ``token_ids`` (prompt/template and sampled ids in order),
    ``loss_mask`` (True exactly on sampled tokens), ``logprobs`` (behaviour logprob, natural log,
    finite, <= 0) and ``versions`` (the sampling policy version), both None where not sampled.
    Optional:
      * ``routed_experts`` -- ``[T, num_moe_layers, top_k]`` int expert ids, -1 where none (R3, arXiv 2510.11370).
      * ``spans`` -- sampled spans and their transform (:class:`SampledSpan`); trainer ingress
        refuses sampled tokens outside a span.
      * ``finish_reason`` -- of the last generation in the segment.
      * ``images`` -- the images shown, in token order (:class:`ImageRef`).

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
        """The sampled spans, else one T=1 span per sampled run (test data; ingress needs explicit spans)."""
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

    ``segments``: more than one when the agent rewrote its context, all under one ``reward``.
    ``status`` ``"failed"`` (with ``error``): the agent or reward raised or timed out; excluded from
    training, never scored 0. ``images``: hex SHA-256 -> encoded bytes (base64), each image once.

    Raises:
        pydantic.ValidationError: ``failed`` without ``error``, a non-finite reward, or an image
            missing from ``images``.
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
    """A reward (or an env's scorer) could not score: the trajectory fails with ``str(exc)``,
    ``"failed: <reason> (<detail>)"``; ``reason`` is short (``timeout``, ``memory``, ``crash``, ...)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"failed: {reason}" + (f" ({detail})" if detail else ""))

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Ray) with reason and detail intact
        return (RewardFailed, (self.reason, self.detail))


class Result(_Strict):
    """What ``Env.step`` or ``ChatAgent.run`` returns.

    ``reward`` (summed over turns by the Env runner), ``observation`` (the next user message: text,
    content parts with images from :func:`molt_plugins.vision.images.image_part`, or None),
    ``terminated`` / ``truncated`` (Gymnasium semantics), ``info``, ``score`` (the task metric),
    ``sampling_params`` for the next turn."""

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
