"""The kernel's wire, OpenAI Chat Completions: request validation, conversion to the ledger's chat
messages, responses (JSON and server-sent events), the OpenAI error shape, and the one field rule every
wire applies (:func:`check_fields`). Every wire decodes into OpenAI-style messages and tools and
:class:`~molt_core.types.SamplingParams`, and encodes an :class:`~molt_core.ledger.AssistantTurn`;
``choices[i].token_ids`` carries the exact sampled ids. The other wires are plugins (``molt_register_wires``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from itertools import accumulate
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from molt_core import _moved
from molt_core.ledger import AssistantTurn

__all__ = ["WireError", "WireRequest", "ChatCompletionRequest", "openai_response", "openai_stream", "openai_error",
           "validation_message", "check_fields", "shown", "one_call_stop", "refuse_forced_tool", "sse", "token_logprobs", "SEED"]


class WireError(Exception):
    """A client error (``status``, ``message``, offending ``param``, OpenAI ``code``), in each wire's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "invalid_request_error", 409: "conflict_error", 500: "server_error", 503: "server_error"}


#: OpenAI error codes whose ``type`` is not their status's (OpenAI's 404 for an unknown previous_response_id)
_OPENAI_CODE_TYPES = {"previous_response_not_found": "invalid_request_error"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` (``type`` by ``code``, else ``status``)."""
    kind = _OPENAI_CODE_TYPES.get(code or "") or _OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One readable line per Pydantic error (``field: problem``) and the first field's name."""
    locs = [".".join(str(x) for x in err["loc"]) or "body" for err in e.errors()[:5]]
    return "; ".join(f"{loc}: {err['msg']}" for loc, err in zip(locs, e.errors())), locs[0] if locs else None


class WireRequest(BaseModel):
    """The base of every wire's request model: strict types (no ``"1"`` -> 1), unknown nested fields ignored,
    unknown top-level fields in ``model_extra`` for :func:`check_fields`."""

    model_config = ConfigDict(extra="allow", strict=True)


# ------------------------------------------------------------------ the one rule for fields

#: OpenAI chat fields accepted and ignored (they cannot change what is sampled)
IGNORED_OPENAI = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

_NO_EFFECT = ("it would change the sampling distribution or the length, and neither the engine nor the trainer's "
              "logprob recompute applies it")
#: OpenAI chat fields refused unless neutral: name -> (neutral values, why); None is always neutral
REFUSED_OPENAI: dict[str, tuple[tuple[Any, ...], str]] = {
    **{name: (neutral, _NO_EFFECT) for name, neutral in (
        ("presence_penalty", (0,)), ("frequency_penalty", (0,)), ("repetition_penalty", (1,)), ("logit_bias", ({},)),
        ("min_p", (0,)), ("min_tokens", (0,)), ("ignore_eos", (False,)), ("length_penalty", (1,)),
        ("use_beam_search", (False,)), ("bad_words", ([],)), ("allowed_token_ids", ([],)), ("verbosity", ()))},
    "best_of": ((1,), "each sample would be its own rollout"),
    "stop_token_ids": (([],), "the session's stop tokens come from the chat template; use 'stop' strings"),
    "response_format": (({"type": "text"},), "constrained decoding is not applied"),
    "reasoning_effort": ((), "reasoning is set per session: POST /sessions with chat_template_kwargs "
                             "(e.g. {\"enable_thinking\": false})"),
    "chat_template_kwargs": ((), "template variables are set per session: POST /sessions with chat_template_kwargs"),
    "functions": ((), "use 'tools'"), "function_call": ((), "use 'tools' and 'tool_choice'"),
    "modalities": ((["text"],), "only text is generated"), "audio": ((), "only text is generated"),
    "prediction": ((), "predicted outputs are not supported"), "web_search_options": ((), "web search is not supported"),
    **{name: ((neutral,), why) for name, neutral, why in (
        ("skip_special_tokens", True, "the reply's text is decoded one way"),
        ("include_stop_str_in_output", False, "the reply's text is decoded one way"),
        ("echo", False, "the prompt is not echoed"), ("add_generation_prompt", True, "the ledger renders the prompt"),
        ("continue_final_message", False, "the ledger renders the prompt"))},
}


def _neutral(v: Any, neutrals: tuple[Any, ...]) -> bool:
    return v is None or any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in neutrals)


def check_fields(extra: dict[str, Any] | None, ignored: frozenset[str],
                 refused: dict[str, tuple[tuple[Any, ...], str]], honoured: list[str]) -> None:
    """Apply the one rule to a request's undeclared top-level fields ``extra``: a field is honoured (declared),
    ignored (cannot change what is sampled), refused unless neutral (it would change the sampling distribution
    or length, which neither the engine nor the trainer's recompute applies), or unknown (refused).

    Raises:
        WireError: 400 naming the first field that is refused with a non-neutral value
            (``code`` ``unsupported_parameter``) or unknown (``code`` ``unknown_parameter``), the value
            sent (:func:`shown`) and what to send instead.
    """
    for name, value in (extra or {}).items():
        neutrals, why = refused.get(name, ((), ""))
        if name in ignored or (name in refused and _neutral(value, neutrals)):
            continue
        if name in refused:
            omit = "omit it" + (f" or send {json.dumps(neutrals[0])}" if neutrals else "")
            raise WireError(400, f"{name}={shown(value)} is not supported here: {why}; {omit}", name,
                            "unsupported_parameter")
        raise WireError(400, f"unknown field {name!r} (sent {shown(value)}): this server refuses fields it does not "
                             f"know; omit it. It honours {', '.join(honoured)}; see docs/README.md (Loopback server) "
                             "for the fields it ignores or refuses", name, "unknown_parameter")


#: one JSON token of ``json.dumps`` output: a string, a punctuation mark, a run of blanks, a scalar
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]|\s+|[^\s\[\]{},:"]+')


def shown(value: Any, limit: int = 100) -> str:
    """``value`` (decoded JSON) as JSON for an error message: whole up to ``limit`` characters, else cut
    after the last whole JSON token that fits (never inside a string or a number) and ``" ..."`` appended."""
    text = json.dumps(value, ensure_ascii=True)
    if len(text) <= limit:
        return text
    toks = _JSON_TOKEN.findall(text)
    n = sum(end <= limit for end in accumulate(map(len, toks)))  # the whole tokens that fit
    return "".join(toks[:n]).rstrip() + " ..."


def one_call_stop(parser: Any, tokenizer: Any, field: str = "parallel_tool_calls", sent: str = "false") -> int:
    """The token id that closes one tool call in ``parser``'s syntax (its ``close`` tag, e.g. Qwen's
    ``</tool_call>``): ``parallel_tool_calls: false`` passes it to the engine as a stop token, so
    sampling stops after the first complete call (recorded like any stop; the ids stay the sampled ones).

    Raises:
        WireError: 400 (``param`` ``field``, ``code`` ``unsupported_value``) when the syntax has no
            close tag that is one token (Llama 3 JSON, Mistral, a tokenizer's response schema).
    """
    close = getattr(parser, "close", None)
    ids = tokenizer.encode(close, add_special_tokens=False) if isinstance(close, str) and close else []
    if len(ids) != 1:
        raise WireError(400, f"{field}={sent} is not supported for this model's tool-call syntax "
                             f"({type(parser).__name__}): no one-token tag closes a call, so sampling cannot stop "
                             f"after the first one; omit {field} (every call the model writes is returned)", field,
                        "unsupported_value")
    return ids[0]


def refuse_forced_tool(choice: Any, field: str, send: str) -> None:
    """Raise the 400 for a forced tool choice ``choice`` at ``field`` (``send``: the values allowed).

    Raises:
        WireError: always: ``code`` ``unsupported_value``, naming the field and the value sent.
    """
    raise WireError(400, f"{field}={shown(choice)} is not supported: forcing a tool is not applied here; send {send} "
                         "(or omit it) and ask for the tool in the prompt", field, "unsupported_value")


#: the ``seed`` field every wire declares: None or an int in [0, 2**63)
SEED = Field(None, ge=0, lt=2**63)


# ------------------------------------------------------------------------------ OpenAI


class OpenAIFunction(WireRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OpenAITool(WireRequest):
    type: str = "function"
    function: OpenAIFunction


class ChatCompletionRequest(WireRequest):
    """``POST /v1/chat/completions`` body (the fields the server honours)."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[OpenAITool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = SEED
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        """Refuse what the server cannot honour (:func:`check_fields` and the declared fields' limits).

        Raises:
            WireError: 400 naming the field and the value sent (``n`` > 1, top_logprobs, a refused or unknown
                field, a forced tool choice, empty stop strings).
        """
        if self.n not in (None, 1):
            raise WireError(400, f"n={self.n} is not supported: each choice would be its own rollout; send n=1 "
                                 "(or omit it) and make one request per sample", "n", "unsupported_value")
        if self.top_logprobs:
            raise WireError(400, f"top_logprobs={self.top_logprobs} is not supported (the engine reports the sampled "
                            "token's logprob only, in logprobs.content); omit it or send 0", "top_logprobs",
                            "unsupported_value")
        check_fields(self.model_extra, IGNORED_OPENAI, REFUSED_OPENAI, list(type(self).model_fields))
        if self.tool_choice not in (None, "auto", "none"):
            refuse_forced_tool(self.tool_choice, "tool_choice", '"auto" or "none"')
        if isinstance(self.stop, list) and not all(self.stop):
            raise WireError(400, f"stop={shown(self.stop)}: stop strings must be non-empty; drop the empty ones",
                            "stop", "invalid_value")

    @property
    def allow_tool_calls(self) -> bool:
        """False for ``tool_choice: "none"``: tools stay in the prompt, the reply is not parsed for calls."""
        return self.tool_choice != "none"

    def internal_messages(self, pending: Any) -> list[dict[str, Any]]:
        """The messages with each ``image_url`` part as the internal part (its check queued on ``pending``).
        Raises: ImageError -- an image part without ``image_url.url`` (naming the field)."""
        out = []
        for i, m in enumerate(self.messages):
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in c):
                m = {**m, "content": [pending.openai_part(p, f"messages[{i}].content[{j}]")
                                      if isinstance(p, dict) and p.get("type") == "image_url" else p
                                      for j, p in enumerate(c)]}
            out.append(m)
        return out

    def tool_result_fields(self) -> list[str]:
        """``messages[i].tool_call_id`` of each tool message, in order."""
        return [f"messages[{i}].tool_call_id" for i, m in enumerate(self.messages)
                if isinstance(m, dict) and m.get("role") == "tool"]

    def tools_openai(self) -> list[dict[str, Any]] | None:
        """The tools in OpenAI form (also under ``tool_choice: "none"``), or None."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in self.tools]

    def stops(self) -> list[str]:
        """The stop strings (``stop`` as a list; none for null)."""
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or []) if isinstance(self.stop, list) else []


def token_logprobs(tokenizer: Any, turn: AssistantTurn) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` of ``turn``: ``{token, logprob (nats), bytes (UTF-8), top_logprobs: []}`` each."""
    out = []
    for tid, lp in zip(turn.token_ids, turn.logprobs):
        s = tokenizer.decode([tid], skip_special_tokens=False)
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
    return out


def _openai_calls(turn: AssistantTurn) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in turn.tool_calls]


def _openai_finish(turn: AssistantTurn) -> str:
    return {"abort": "stop"}.get(turn.finish_reason, turn.finish_reason)


def _usage(turn: AssistantTurn) -> dict[str, int]:
    n = len(turn.token_ids)
    return {"prompt_tokens": turn.prompt_len, "completion_tokens": n, "total_tokens": turn.prompt_len + n}


def openai_response(turn: AssistantTurn, tokenizer: Any, model: str) -> dict[str, Any]:
    """A ``chat.completion`` for ``turn`` (one choice with ``token_ids``; think text in ``reasoning_content``)."""
    msg: dict[str, Any] = {"role": "assistant", "content": turn.content if (turn.content or not turn.tool_calls) else None}
    if turn.tool_calls:
        msg["tool_calls"] = _openai_calls(turn)
    if turn.reasoning is not None:
        msg["reasoning_content"] = turn.reasoning
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": msg, "finish_reason": _openai_finish(turn),
                     "logprobs": {"content": token_logprobs(tokenizer, turn)}, "token_ids": list(turn.token_ids)}],
        "usage": _usage(turn),
    }


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event: ``data`` (a string as is, else JSON), under ``event`` when given."""
    head = f"event: {event}\n" if event else ""
    return head + "data: " + (data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)) + "\n\n"


def openai_stream(turn: AssistantTurn, tokenizer: Any, model: str, include_usage: bool = False) -> Iterator[str]:
    """``chat.completion.chunk`` events for ``turn`` (generated in full first), usage optional, then ``[DONE]``."""
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]})

    yield chunk({"role": "assistant", "content": ""})
    if turn.reasoning is not None:
        yield chunk({"reasoning_content": turn.reasoning})
    yield chunk({"content": turn.content}, logprobs={"content": token_logprobs(tokenizer, turn)},
                token_ids=list(turn.token_ids))
    for i, c in enumerate(_openai_calls(turn)):
        yield chunk({"tool_calls": [{"index": i, **c}]})
    yield chunk({}, _openai_finish(turn))
    if include_usage:
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                    "usage": _usage(turn)})
    yield sse("[DONE]")


def __getattr__(name: str) -> object:
    """The Anthropic wire's names that lived here (:data:`molt_core._moved.MOVED_NAMES`)."""
    return _moved.moved_attr(__name__, name)
