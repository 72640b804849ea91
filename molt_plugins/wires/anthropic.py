"""The Anthropic Messages wire (``POST /s/{sid}/v1/messages``, the Anthropic SDK's): request
validation, conversion of ``messages`` / ``system`` / ``tools`` to the ledger's chat messages, the
``message`` object and its server-sent events, and Anthropic's error shape. Token-exact like the
other wires: the message carries the sampled ids as a top-level ``token_ids`` (and in
``message_start`` when streaming). Mounted through ``molt_register_wires`` (:class:`AnthropicWire`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from molt_core.ledger import AssistantTurn
from molt_core.server.images import convert_checked
from molt_core.server.tool_results import match_tool_results
from molt_core.server.wires import SEED, WireError, WireRequest, check_fields, one_call_stop, refuse_forced_tool, shown, sse
from molt_plugins.wires.common import joined

__all__ = ["AnthropicWire", "MessagesRequest", "IGNORED_ANTHROPIC", "REFUSED_ANTHROPIC", "ERROR_PREFIX", "anthropic_error",
           "anthropic_response", "anthropic_stream"]

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 409: "invalid_request_error", 500: "api_error", 503: "overloaded_error"}

#: Anthropic messages fields accepted and ignored
IGNORED_ANTHROPIC = frozenset({"metadata", "service_tier"})
_THREAD = ("message threads are not kept (the session's ledger holds the conversation); send the whole "
           "conversation in messages without thread")
#: Anthropic messages fields refused unless neutral
REFUSED_ANTHROPIC: dict[str, tuple[tuple[Any, ...], str]] = {
    "thinking": (({"type": "disabled"},), "thinking is set per session: POST /sessions with chat_template_kwargs "
                                          "(e.g. {\"enable_thinking\": true}); a token budget is not applied"),
    "thread": ((), _THREAD),
}


def anthropic_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Anthropic error body: ``{"type": "error", "error": {"type", "message"}}``, with
    ``error.details.error_code`` = ``code`` when there is one (where the Anthropic SDK reads a cause,
    e.g. ``thread_unsupported_request``, on which its tool runner resends without ``thread``)."""
    err: dict[str, Any] = {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message}
    if code:
        err["details"] = {"error_code": code}
    return {"type": "error", "error": err}


class AnthropicTool(WireRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicMessage(WireRequest):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(WireRequest):
    """``POST /v1/messages`` body (fields the server honours; others are ignored)."""

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    stream: bool | None = False
    seed: int | None = SEED

    def check(self) -> None:
        """Raises: WireError (400) for a forced tool choice, empty stop sequences, a refused
        field with a non-neutral value or an unknown field (:func:`check_fields`); a ``thread``
        (the message-threads beta) with ``error.details.error_code`` ``thread_unsupported_request``."""
        thread = (self.model_extra or {}).get("thread")
        if thread is not None:  # the code the SDK's fallback to sending the whole history looks for
            raise WireError(400, f"thread={shown(thread)} is not supported here: {_THREAD}", "thread",
                            "thread_unsupported_request")
        check_fields(self.model_extra, IGNORED_ANTHROPIC, REFUSED_ANTHROPIC, list(type(self).model_fields))
        if self.tool_choice and self.tool_choice.get("type") not in ("auto", "none"):
            refuse_forced_tool(self.tool_choice, "tool_choice", '{"type": "auto"} or {"type": "none"}')
        if self.stop_sequences is not None and not all(self.stop_sequences):
            raise WireError(400, f"stop_sequences={shown(self.stop_sequences)}: stop sequences must be non-empty "
                                 "strings; drop the empty ones", "stop_sequences", "invalid_value")

    @property
    def one_call(self) -> bool:
        """``tool_choice.disable_parallel_tool_use: true`` with tools the reply is parsed for: at most one call."""
        return bool(self.tools) and self.allow_tool_calls and (self.tool_choice or {}).get("disable_parallel_tool_use") is True

    @property
    def allow_tool_calls(self) -> bool:
        """False for ``tool_choice: {"type": "none"}`` (tools kept in the prompt, reply not parsed for calls)."""
        return (self.tool_choice or {}).get("type") != "none"

    def tool_result_fields(self) -> list[str]:
        """``messages[i].content[j].tool_use_id`` of each ``tool_result`` block, in order (the tool
        messages :meth:`openai_messages` makes; :func:`~molt_core.server.tool_results.match_tool_results`)."""
        return [f"messages[{i}].content[{j}].tool_use_id" for i, m in enumerate(self.messages)
                if m.role == "user" and isinstance(m.content, list)
                for j, b in enumerate(m.content) if b.get("type") == "tool_result"]

    def tools_openai(self) -> list[dict[str, Any]] | None:
        """The tools in OpenAI form (also under ``tool_choice`` none), or None."""
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = t.input_schema
            out.append({"type": "function", "function": fn})
        return out

    def openai_messages(self, pending: Any = None) -> list[dict[str, Any]]:
        """Convert to OpenAI-style messages: ``system`` first; ``tool_result`` blocks become
        ``role: tool`` messages (in order, before the user text of the same turn);
        ``thinking`` / ``text`` / ``tool_use`` assistant blocks become reasoning, content
        and ``tool_calls``; ``image`` blocks (a user turn's or a tool result's) become internal
        image parts next to the text (the modality's ``wire_images``), their checks
        appended to ``pending`` (None: checked here).

        Raises:
            WireError: 400 naming ``messages[i].content[j]`` for an unsupported or malformed block.
            ImageError: a malformed or (``pending`` None) refused image, naming its field.
        """
        return convert_checked(self._convert, pending)

    def _convert(self, pending: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": self.system if isinstance(self.system, str)
                        else _block_text(self.system, "system")})
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if m.role not in ("user", "assistant"):
                raise WireError(400, f"{where}.role must be 'user' or 'assistant', got {m.role!r}", f"{where}.role")
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            if m.role == "user":
                parts: list[Any] = []  # text (str) and image parts, in order
                for j, b in enumerate(m.content):
                    kind = b.get("type")
                    if kind == "text" and isinstance(b.get("text"), str):
                        parts.append(b["text"])
                    elif kind == "image":
                        parts.append(pending.anthropic_block(b, f"{where}.content[{j}]"))
                    elif kind == "tool_result":
                        c = b.get("content", "")
                        content = c if isinstance(c, str) else _block_content(c, f"{where}.content[{j}].content", pending)
                        content = _failed(content, b.get("is_error", False), f"{where}.content[{j}].is_error")
                        out.append({"role": "tool", "content": content, "tool_call_id": str(b.get("tool_use_id", ""))})
                    else:
                        raise WireError(400, f"{where}.content[{j}]: unsupported block type {kind!r} in a user turn "
                                             "(text, image and tool_result are supported)", f"{where}.content")
                if parts or not any(b.get("type") == "tool_result" for b in m.content):
                    out.append({"role": "user", "content": joined(parts)})
            else:
                text, reasoning, calls = [], None, []
                for j, b in enumerate(m.content):
                    kind = b.get("type")
                    if kind == "text" and isinstance(b.get("text"), str):
                        text.append(b["text"])
                    elif kind == "thinking" and isinstance(b.get("thinking"), str):
                        reasoning = b["thinking"]
                    elif kind == "redacted_thinking":
                        continue
                    elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
                        calls.append({"id": str(b.get("id", "")), "type": "function",
                                      "function": {"name": b["name"], "arguments": b.get("input", {})}})
                    else:
                        raise WireError(400, f"{where}.content[{j}]: unsupported or malformed block {kind!r} in an "
                                             "assistant turn (text, thinking and tool_use are supported)", f"{where}.content")
                msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
                if reasoning is not None:
                    msg["reasoning_content"] = reasoning
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
        return out


def _block_content(blocks: Any, where: str, pending: Any) -> str | list[Any]:
    """A tool result's content blocks: text and image blocks (:func:`~molt_plugins.wires.common.joined`)."""
    if not isinstance(blocks, list):
        raise WireError(400, f"{where} must be a string or a list of text and image blocks", where)
    parts: list[Any] = []
    for j, b in enumerate(blocks):
        if isinstance(b, dict) and b.get("type") == "image":
            parts.append(pending.anthropic_block(b, f"{where}[{j}]"))
        elif isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
            parts.append(b["text"])
        else:
            raise WireError(400, f"{where}[{j}] must be a text or image block", where)
    return joined(parts)


#: what a failed tool's result starts with (``tool_result.is_error: true``): the Qwen and Hermes
#: templates render a tool message's content only, with no field for a failure
ERROR_PREFIX = "Error: "


def _failed(content: str | list[Any], is_error: Any, where: str) -> str | list[Any]:
    """``content`` of a tool result, prefixed with :data:`ERROR_PREFIX` when ``is_error`` is true (a
    content list gets it as a leading text part). Raises: WireError -- ``is_error`` not a boolean."""
    if is_error is None or is_error is False:
        return content
    if is_error is not True:
        raise WireError(400, f"{where}={shown(is_error)} is not a boolean: send true (a failed tool), false or omit it",
                        where, "invalid_value")
    if isinstance(content, str):
        return ERROR_PREFIX + content if content else ERROR_PREFIX.rstrip()
    return [{"type": "text", "text": ERROR_PREFIX}, *content]


def _block_text(blocks: list[dict[str, Any]], where: str) -> str:
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise WireError(400, f"{where}[{j}] must be a text block {{'type': 'text', 'text': ...}}", where)
        parts.append(b["text"])
    return "".join(parts)


def _anthropic_stop(turn: AssistantTurn) -> str:
    # a cut is a cut first: a turn cut by max_tokens right after a complete tool call is max_tokens
    if turn.finish_reason == "length":
        return "max_tokens"
    if turn.tool_calls:
        return "tool_use"
    return "end_turn" if turn.stop_sequence is None else "stop_sequence"


def _anthropic_blocks(turn: AssistantTurn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content})
    for c in turn.tool_calls:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]})
    return blocks


def anthropic_response(turn: AssistantTurn, model: str) -> dict[str, Any]:
    """An Anthropic ``message`` object for ``turn`` with a top-level ``token_ids``."""
    return {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(turn), "stop_reason": _anthropic_stop(turn),
            "stop_sequence": turn.stop_sequence,
            "usage": {"input_tokens": turn.prompt_len, "output_tokens": len(turn.token_ids)},
            "token_ids": list(turn.token_ids)}


def anthropic_stream(turn: AssistantTurn, model: str) -> Iterator[str]:
    """Anthropic streaming events for ``turn``: ``message_start`` (its message carries
    ``token_ids``), a start/delta/stop triple per content block, ``message_delta``,
    ``message_stop``."""
    full = anthropic_response(turn, model)
    start = {**full, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": turn.prompt_len, "output_tokens": 0}}
    yield sse({"type": "message_start", "message": start}, "message_start")
    for i, b in enumerate(full["content"]):
        if b["type"] == "thinking":
            yield sse({"type": "content_block_start", "index": i, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": i, "delta": {"type": "thinking_delta", "thinking": b["thinking"]}}, "content_block_delta")
            yield sse({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
        elif b["type"] == "text":
            yield sse({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": b["text"]}}, "content_block_delta")
        else:
            yield sse({"type": "content_block_start", "index": i,
                        "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}, "content_block_start")
            yield sse({"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": i}, "content_block_stop")
    yield sse({"type": "message_delta", "delta": {"stop_reason": full["stop_reason"], "stop_sequence": full["stop_sequence"]},
                "usage": {"output_tokens": len(turn.token_ids)}}, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


class AnthropicWire:
    """The wire object ``molt_register_wires`` registers as ``anthropic``: mounts
    ``POST /s/{sid}/v1/messages``; its error shape (:func:`anthropic_error`) answers every error of
    a path ending in ``/messages``."""

    paths = ("/v1/messages",)
    server_error_type = "api_error"
    error_body = staticmethod(anthropic_error)

    @staticmethod
    def owns(path: str) -> bool:
        """True for a path ending in ``/messages`` (the Anthropic SDK's route)."""
        return path.rstrip("/").endswith("/messages")

    def mount(self, server: Any) -> None:
        """Add the route to ``server`` (a :class:`~molt_core.server.app.WireServer`)."""

        @server.route("/s/{sid}/v1/messages")
        async def messages(sid: str, request: Request) -> Any:
            async def handle() -> Any:
                s, req, size = await server.session_request(request, sid, MessagesRequest)
                params = server.params_of(req.temperature, req.top_p, req.top_k, req.seed, list(req.stop_sequences or []),
                                          [one_call_stop(s.ledger.tool_parser, server.tokenizer, "tool_choice.disable_parallel_tool_use",
                                                         "true")] if req.one_call else ())
                pending = server.images()
                msgs = req.openai_messages(pending)
                await server.checked(pending, size)
                msgs = match_tool_results(msgs, req.tool_result_fields())  # before the engine: a 400 naming the field
                turn = await server.run_turn(s, request, msgs, req.tools_openai(), params, req.max_tokens,
                                             req.allow_tool_calls, size)
                if req.stream:
                    return StreamingResponse(anthropic_stream(turn, server.model_name), media_type="text/event-stream")
                return anthropic_response(turn, server.model_name)

            return await server.guarded(self, handle)
