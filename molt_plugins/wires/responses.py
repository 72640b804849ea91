"""The OpenAI Responses wire (``POST /s/{sid}/v1/responses``, the OpenAI Agents SDK's default): request
validation, conversion of ``input`` items to the ledger's chat messages, and the ``response``
object and its server-sent events. Token-exact like the other wires: the response carries the
sampled ids as a top-level ``token_ids`` (and in ``response.completed`` when streaming).

Input items: a string (one user message); messages ``{"role", "content"}`` with
``input_text`` / ``output_text`` parts (and ``input_image`` in a user message or a
``function_call_output``, the modality's ``wire_images``); ``function_call`` (an assistant tool call; consecutive
calls and the assistant message before them form one assistant turn); ``function_call_output``
(a tool message); ``reasoning`` (the next assistant turn's reasoning). ``previous_response_id``
continues a response stored in the same session (``store``, default true;
:mod:`molt_plugins.wires.response_store`); ``conversation`` is refused (chain turns by
``previous_response_id`` or send the whole input: the session's ledger extends it token-exactly).
Mounted through ``molt_register_wires`` (:class:`ResponsesWire`); errors in OpenAI's shape.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from molt_core.ledger import AssistantTurn
from molt_core.server.images import convert_checked
from molt_core.server.tool_results import match_tool_results
from molt_core.server.wires import (SEED, WireError, WireRequest, check_fields, one_call_stop, refuse_forced_tool, shown,
                                    sse, token_logprobs)
from molt_plugins.wires.common import joined
from molt_plugins.wires.response_store import ResponseStore

__all__ = ["ResponsesRequest", "ResponsesWire", "IGNORED_RESPONSES", "REFUSED_RESPONSES", "responses_response",
           "responses_stream"]

#: Responses fields accepted and ignored (they cannot change what is sampled)
IGNORED_RESPONSES = frozenset({"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                               "prompt_cache_retention", "include", "stream_options"})
_STATEFUL = ("conversation objects are not supported: chain turns with previous_response_id or send the whole "
             "conversation as input (the session's ledger extends it)")
#: Responses fields refused unless neutral: name -> (neutral values, why); None is always neutral
REFUSED_RESPONSES: dict[str, tuple[tuple[Any, ...], str]] = {
    "conversation": ((), _STATEFUL),
    "prompt": ((), "stored prompts are not supported; send instructions and input"),
    "reasoning": ((), "reasoning is set per session: POST /sessions with chat_template_kwargs "
                      "(e.g. {\"enable_thinking\": false})"),
    "text": (({"format": {"type": "text"}},), "constrained decoding is not applied"),
    "truncation": (("disabled",), "a prompt that does not fit is refused, never truncated"),
    "top_logprobs": ((0,), "the engine reports the sampled token's logprob only"),
    "max_tool_calls": ((), "every call the model writes is returned"),
    "background": ((False,), "responses are answered synchronously"),
}


class ResponsesRequest(WireRequest):
    """``POST /v1/responses`` body (the one field rule: :func:`~molt_core.server.wires.check_fields`)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = SEED
    previous_response_id: str | None = None
    store: bool | None = None  # None: true (OpenAI's default)
    parallel_tool_calls: bool | None = None  # false: sampling stops after the first complete call

    def check(self) -> None:
        """Raises: WireError (400 naming the field) for a refused or unknown field, a forced tool
        choice, or a tool that is not a function tool."""
        check_fields(self.model_extra, IGNORED_RESPONSES, REFUSED_RESPONSES, list(type(self).model_fields))
        if self.tool_choice not in (None, "auto", "none"):
            refuse_forced_tool(self.tool_choice, "tool_choice", '"auto" or "none"')
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function" or not isinstance(t.get("name"), str) or not t["name"]:
                raise WireError(400, f"tools[{i}]={shown(t)} is not supported: only function tools are (built-in "
                                     "tools are not); send {\"type\": \"function\", \"name\": ..., \"parameters\": "
                                     "...} and run the tool in your agent", f"tools[{i}]", "unsupported_value")

    @property
    def allow_tool_calls(self) -> bool:
        """False for ``tool_choice: "none"`` (tools kept in the prompt, reply not parsed for calls)."""
        return self.tool_choice != "none"

    def tool_result_fields(self) -> list[str]:
        """``input[i].call_id`` of each ``function_call_output`` item, in order
        (:func:`~molt_core.server.tool_results.match_tool_results`)."""
        items = self.input if isinstance(self.input, list) else []
        return [f"input[{i}].call_id" for i, it in enumerate(items) if isinstance(it, dict)
                and it.get("type") == "function_call_output"]

    def tools_openai(self) -> list[dict[str, Any]] | None:
        """Function tools in Chat Completions form, or None."""
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t["name"]}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": fn})
        return out

    def openai_messages(self, pending: Any = None) -> list[dict[str, Any]]:
        """Chat messages for the ledger: ``instructions`` first as the system message;
        ``input_image`` parts (a user message's or a ``function_call_output``'s) become internal
        image parts (the modality's ``wire_images``), their checks appended to ``pending``
        (None: checked here).

        Raises:
            WireError: 400 naming ``input[i]`` for an unsupported or malformed item.
            ImageError: a malformed or (``pending`` None) refused image, naming its field.
        """
        return convert_checked(self._convert, pending)

    def _convert(self, pending: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        reasoning: str | None = None
        open_turn: dict[str, Any] | None = None  # the assistant turn function calls attach to
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise WireError(400, f"{where} must be an object", where)
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise WireError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                    f"{where}.role")
                text = _parts(item.get("content"), where, pending if role == "user" else None)
                if role == "assistant":
                    msg: dict[str, Any] = {"role": "assistant", "content": text}
                    if reasoning is not None:
                        msg["reasoning_content"], reasoning = reasoning, None
                    out.append(msg)
                    open_turn = msg
                else:
                    out.append({"role": "system" if role == "developer" else role, "content": text})
                    open_turn = None
            elif kind == "function_call":
                name, args = item.get("name"), item.get("arguments", "{}")
                if not isinstance(name, str) or not name or not isinstance(args, str):
                    raise WireError(400, f"{where}: a function_call needs a name and its arguments as a JSON string",
                                    where)
                if open_turn is None:
                    open_turn = {"role": "assistant", "content": ""}
                    if reasoning is not None:
                        open_turn["reasoning_content"], reasoning = reasoning, None
                    out.append(open_turn)
                open_turn.setdefault("tool_calls", []).append(
                    {"id": str(item.get("call_id") or ""), "type": "function", "function": {"name": name, "arguments": args}})
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else _parts(output, where, pending, "output")
                out.append({"role": "tool", "content": text, "tool_call_id": str(item.get("call_id") or "")})
                open_turn = None
            elif kind == "reasoning":
                parts = [c.get("text", "") for c in (item.get("content") or []) if isinstance(c, dict)]
                if not parts:
                    parts = [c.get("text", "") for c in (item.get("summary") or []) if isinstance(c, dict)]
                reasoning = "".join(p for p in parts if isinstance(p, str))
            else:
                raise WireError(400, f"{where}: unsupported input item type {kind!r} (message, function_call, "
                                     "function_call_output and reasoning are supported)", where)
        return out


def _parts(content: Any, where: str, pending: Any, key: str = "content") -> str | list[Any]:
    """``<where>.<key>`` (a string or a list of parts): the text joined, or with ``input_image``
    parts (allowed where ``pending`` is given) a list of text and internal image parts
    (:func:`~molt_plugins.wires.common.joined`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(400, f"{where}.{key} must be a string or a list of text parts", f"{where}.{key}")
    parts: list[Any] = []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "input_image" and pending is not None:
            parts.append(pending.responses_part(p, f"{where}.{key}[{j}]"))
            continue
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            what = "input_text, output_text and input_image" if pending is not None else "input_text / output_text"
            raise WireError(400, f"{where}.{key}[{j}]: only {what} parts are supported here, got {kind!r}",
                            f"{where}.{key}")
        parts.append(p["text"])
    return joined(parts)


def _items(turn: AssistantTurn, tokenizer: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if turn.reasoning is not None:
        items.append({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                      "content": [{"type": "reasoning_text", "text": turn.reasoning}], "status": "completed"})
    if turn.content or not turn.tool_calls:
        items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": turn.content, "annotations": [],
                                   "logprobs": token_logprobs(tokenizer, turn)}]})
    for c in turn.tool_calls:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": c["id"], "name": c["name"],
                      "arguments": json.dumps(c["arguments"], ensure_ascii=False), "status": "completed"})
    return items


def responses_response(turn: AssistantTurn, tokenizer: Any, model: str, req: ResponsesRequest) -> dict[str, Any]:
    """A ``response`` object for ``turn`` (``status`` ``incomplete`` with reason
    ``max_output_tokens`` when the generation was cut) with a top-level ``token_ids``, a fresh
    ``resp_<hex>`` ``id`` and ``previous_response_id`` and ``store`` as requested (``store``
    null: true)."""
    cut = turn.finish_reason == "length"
    n = len(turn.token_ids)
    return {
        "id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if cut else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": req.instructions, "output": _items(turn, tokenizer),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else "auto", "tools": req.tools or [],
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "usage": {"input_tokens": turn.prompt_len, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": turn.prompt_len + n},
        "token_ids": list(turn.token_ids),
    }


def responses_stream(full: dict[str, Any]) -> Iterator[str]:
    """Server-sent events for ``full`` (a turn's :func:`responses_response`, generated in full
    first): ``response.created``, ``response.in_progress``, per output item
    ``output_item.added`` / its deltas / ``output_item.done``, then ``response.completed`` (or
    ``response.incomplete``) carrying the whole response with ``token_ids``."""
    seq = iter(range(1 << 30))

    def ev(kind: str, **data: Any) -> str:
        return sse({"type": kind, "sequence_number": next(seq), **data}, kind)

    start = {**full, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    start.pop("token_ids")
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    for i, item in enumerate(full["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield ev("response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []})
            yield ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            yield ev("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                     delta=part["text"], logprobs=part["logprobs"])
            yield ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                     text=part["text"], logprobs=part["logprobs"])
            yield ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        elif item["type"] == "function_call":
            yield ev("response.output_item.added", output_index=i, item={**item, "arguments": "", "status": "in_progress"})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i, delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                     arguments=item["arguments"], name=item["name"])
        else:
            text = item["content"][0]["text"]
            yield ev("response.output_item.added", output_index=i, item={**item, "content": [], "status": "in_progress"})
            yield ev("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text)
            yield ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
        yield ev("response.output_item.done", output_index=i, item=item)
    yield ev("response.incomplete" if full["status"] == "incomplete" else "response.completed", response=full)


class ResponsesWire:
    """The wire object ``molt_register_wires`` registers as ``responses``: mounts
    ``POST /s/{sid}/v1/responses``; a session's stored responses live in its
    ``state["responses"]`` (a :class:`~molt_plugins.wires.response_store.ResponseStore`)."""

    paths = ("/v1/responses",)

    def mount(self, server: Any) -> None:
        """Add the route to ``server`` (a :class:`~molt_core.server.app.WireServer`)."""
        @server.route("/s/{sid}/v1/responses")
        async def responses(sid: str, request: Request) -> Any:
            async def handle() -> Any:
                s, req, size = await server.session_request(request, sid, ResponsesRequest)
                store = s.state.setdefault("responses", ResponseStore())
                one = req.parallel_tool_calls is False and req.tools and req.allow_tool_calls  # stop after one call
                params = server.params_of(req.temperature, req.top_p, req.top_k, req.seed, [],
                                          [one_call_stop(s.ledger.tool_parser, server.tokenizer)] if one else ())
                pending = server.images()
                msgs = store.continued(req, req.openai_messages(pending))  # 404: previous_response_id not stored
                await server.checked(pending, size)
                msgs = match_tool_results(msgs, req.tool_result_fields())  # before the engine: a 400 naming the field
                turn = await server.run_turn(s, request, msgs, req.tools_openai(), params, req.max_output_tokens,
                                             req.allow_tool_calls, size)
                body = responses_response(turn, server.tokenizer, server.model_name, req)
                # no await since run_turn committed: the ledger's history is this turn's (the session's lock is released)
                store.record(req, s.ledger.history, body)
                if req.stream:
                    return StreamingResponse(responses_stream(body), media_type="text/event-stream")
                return body

            return await server.guarded("openai", handle)
