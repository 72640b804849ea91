"""What the ledger hands out: :class:`Prepared` plans, :class:`AssistantTurn` turns, its errors and ``info`` keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from molt_core.types import ImageRef, SampledSpan, Segment

__all__ = ["LEDGER_INFO_KEYS", "REWRITE_CAUSES", "AssistantTurn", "LedgerConflict", "Prepared", "PromptTooLong"]

#: ``Trajectory.info`` keys the ledger owns: an agent's ``info`` never overwrites them
LEDGER_INFO_KEYS = ("requests", "context_reencoded_tokens", "length_cut_turns", "rewrite_causes")

#: why a request could not extend the open segment (``Prepared.cause``; per rollout in
#: ``info["rewrite_causes"]``): ``reply_edited`` (a returned assistant message came back changed),
#: ``history_edited`` (another message differs, or fewer messages than the history),
#: ``tools_changed``, ``template_rewrites_history`` (the template renders the echoed history
#: differently once new messages follow, e.g. Qwen3 dropping ``<think>`` blocks, B03),
#: ``template_unprobed`` (the template's assistant turn could not be probed)
REWRITE_CAUSES = ("reply_edited", "history_edited", "tools_changed", "template_rewrites_history", "template_unprobed")


class LedgerConflict(RuntimeError):
    """A :class:`Prepared` was committed after another request changed the ledger."""


class PromptTooLong(ValueError):
    """The prompt does not fit the context: ``tokens`` (exact, or a lower bound when
    ``estimated``) >= ``limit``."""

    def __init__(self, message: str, tokens: int, limit: int, estimated: bool) -> None:
        super().__init__(message)
        self.tokens, self.limit, self.estimated = tokens, limit, estimated


@dataclass
class AssistantTurn:
    """One generation, parsed into a chat message; ``token_ids`` / ``logprobs`` are exact.

    ``content``: visible text (no think or tool-call blocks, stop removed); ``reasoning``: the think
    block's text or None; ``tool_calls``: ``[{"id", "name", "arguments": dict}]`` from the ledger's
    tool parser (malformed blocks stay in ``content``); ``raw``: the body as the model produced it
    (body prefix + sampled text, tool-call blocks removed), what the history holds;
    ``finish_reason``: stop / length / abort / tool_calls; ``stop_sequence``: the stop string that
    ended it; ``prompt_len``: engine prompt length in tokens.
    """

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    raw: str
    finish_reason: str
    stop_sequence: str | None
    token_ids: list[int]
    logprobs: list[float]
    prompt_len: int

    def message(self) -> dict[str, Any]:
        """The assistant message in canonical OpenAI form (as stored in the ledger history)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.raw}
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in self.tool_calls]
        return msg


@dataclass
class Prepared:
    """The plan for one request (from :meth:`Ledger.prepare`; nothing mutated yet).

    ``mode``: start / extend / rewrite / retry. ``prompt_ids``: the engine's prompt (extend: the open
    segment's ids + ``tail_ids``). ``tail_ids``: appended before the sampled ids (start/rewrite: the
    whole prompt). ``cached``: the turn a retry returns. ``reencoded``: on a rewrite, prompt tokens
    re-rendering held history (:meth:`Ledger.prepare`), else 0. ``allow_tool_calls``: False for
    ``tool_choice: none``. ``images``: encoded bytes of each image in ``prompt_ids``, in token order
    (for ``engine.generate(..., images=...)``); ``image_refs``: the placeholder runs ``tail_ids``
    adds. ``cause``: a rewrite's :data:`REWRITE_CAUSES` entry, else None.
    """

    mode: Literal["start", "extend", "rewrite", "retry"]
    prompt_ids: list[int]
    tail_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_text: str
    key: tuple[Any, ...]
    epoch: int
    cached: AssistantTurn | None = None
    reencoded: int = 0
    allow_tool_calls: bool = True
    images: list[bytes] = field(default_factory=list)
    image_refs: list[ImageRef] = field(default_factory=list)
    cause: str | None = None


@dataclass
class _Open:
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    spans: list[SampledSpan] = field(default_factory=list)
    routed: list[Any] | None = None
    routed_ok: bool = True
    finish_reason: str | None = None
    images: list[ImageRef] = field(default_factory=list)

    def segment(self) -> Segment:
        routed = self.routed if (self.routed_ok and self.routed is not None and len(self.routed) == len(self.token_ids)) else None
        # deep copies: a caller mutating a returned segment never edits the ledger's
        return Segment(token_ids=list(self.token_ids), loss_mask=list(self.loss_mask), logprobs=list(self.logprobs),
                       versions=list(self.versions), routed_experts=routed, spans=[sp.model_copy(deep=True) for sp in self.spans],
                       finish_reason=self.finish_reason, images=[im.model_copy() for im in self.images])

