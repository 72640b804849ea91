"""Issue 12, server items: every bad request a 4xx in the wire's shape (lone surrogates, unknown
routes and methods, sampling fields nobody applies), tool calls parsed JSON-aware, one huge
prompt stalls no other session, a client that leaves commits nothing, fresh samples on request,
``tool_choice: none`` keeps the conversation extending. Each case runs on both wires, streaming
and not, and directly and through the request router (real HTTP)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch

from fake_engine import EchoEngine, ScriptedEngine
from molt_core.models import load_tokenizer
from molt_core.server import start_server
from molt_core.cli.router import start_router
from molt_core.server.wires import IGNORED_OPENAI, REFUSED_OPENAI
from molt_plugins.wires.anthropic import IGNORED_ANTHROPIC, REFUSED_ANTHROPIC

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "write_file", "description": "write a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "text": {"type": "string"}}}}}]
A_TOOLS = [{"name": "write_file", "description": "write a file", "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture()
def stack(tok):
    """``make(engine, **app_kwargs)`` -> (server, router over it); both stopped afterwards."""
    handles = []

    def make(engine, **kw):
        h = start_server(engine, tok, admin_key="adm", **kw)
        r = start_router([h], admin_key="adm")
        handles.extend([r, h])
        return h, r

    yield make
    for h in handles:
        h.stop()


def open_session(target):
    r = httpx.post(f"{target.base_url}/sessions", headers={"x-api-key": "adm"})
    assert r.status_code == 200
    return r.json()


def post(info, wire, body, stream=False, headers=None, timeout=30.0, raw=None):
    url = info["openai_base_url"] + "/chat/completions" if wire == "openai" else info["anthropic_base_url"] + "/v1/messages"
    h = {"x-api-key": info["api_key"], "content-type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps({**body, "stream": stream}).encode()
    return httpx.post(url, content=content, headers=h, timeout=timeout)


def body_of(wire, content="hi", **extra):
    if wire == "openai":
        return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}], **extra}


def assert_wire_error(r, wire, status, message=None, param=None, code=None):
    assert r.status_code == status, r.text
    j = r.json()
    if wire == "openai":
        assert set(j) == {"error"} and set(j["error"]) == {"message", "type", "param", "code"}
        assert (j["error"]["param"], j["error"]["code"]) == (param, code)
        got = j["error"]["message"]
    else:
        # the code is Anthropic's error.details.error_code (where the SDK reads a cause)
        assert j["type"] == "error" and set(j["error"]) == {"type", "message"} | ({"details"} if code else set())
        assert j["error"].get("details") == ({"error_code": code} if code else None)
        got = j["error"]["message"]
    if message is not None:
        assert got == message
    return got


def traj(h, sid):
    return h.trajectory(sid)


WIRES = ["openai", "anthropic"]
TARGETS = ["direct", "router"]


# ------------------------------------------------------------------ item 1: lone surrogates


SURROGATE_MSG = ("{} holds a lone UTF-16 surrogate (\\ud800) at character 1: that is not valid Unicode text. "
                 "Send UTF-8 text (a surrogate escape must come as a high+low pair)")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", WIRES)
def test_lone_surrogate_is_a_400_naming_the_field_before_tokenizing(tok, stack, wire, stream, target):
    eng = ScriptedEngine(tok, ["ok"] * 4)
    h, r = stack(eng)
    info = open_session(h if target == "direct" else r)
    led = h.sessions.ledger(info["session_id"])
    calls = []
    orig = led.prepare
    led.prepare = lambda *a, **k: calls.append(1) or orig(*a, **k)  # nothing may reach the tokenizer
    raw = json.dumps(body_of(wire, "a\ud800b", stream=stream)).encode()
    assert b'"a\\ud800b"' in raw  # sent with the JSON escape
    got = post(info, wire, None, raw=raw)
    assert_wire_error(got, wire, 400, SURROGATE_MSG.format("messages[0].content"),
                      *(("messages[0].content", "invalid_unicode") if wire == "openai" else (None, "invalid_unicode")))
    # deeper fields: a tool call's arguments, the Anthropic system prompt, a dict key
    if wire == "openai":
        msgs = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "write_file", "arguments": json.dumps({"text": "a\ud800b"})}}]}]
        # the arguments string holds the escape as text (valid); an object argument holds the surrogate itself
        msgs[1]["tool_calls"][0]["function"]["arguments"] = {"text": "a\ud800b"}
        got = post(info, wire, {"model": "m", "messages": msgs})
        assert_wire_error(got, wire, 400, SURROGATE_MSG.format("messages[1].tool_calls[0].function.arguments.text"),
                          "messages[1].tool_calls[0].function.arguments.text", "invalid_unicode")
    else:
        got = post(info, wire, {**body_of(wire), "system": "a\ud800b"})
        assert_wire_error(got, wire, 400, SURROGATE_MSG.format("system"), None, "invalid_unicode")
    got = post(info, wire, {**body_of(wire), "metadata": {"a\ud800b": 1}})
    assert_wire_error(got, wire, 400, SURROGATE_MSG.format("metadata"),
                      *(("metadata", "invalid_unicode") if wire == "openai" else (None, "invalid_unicode")))
    assert calls == [] and eng.calls == 0 and traj(h, info["session_id"]).segments == []
    # a proper surrogate pair is one character: accepted
    ok = post(info, wire, body_of(wire, "smile \ud83d\ude00"))
    assert ok.status_code == 200 and eng.calls == 1
    assert "smile \U0001F600" in tok.decode(traj(h, info["session_id"]).segments[0].token_ids)


# ------------------------------------------------------------------ item 4: 404 / 405


HINT = ("no route {}: this server gives every session its own base URL. Open a session with POST /sessions "
        "(admin key), then point the OpenAI SDK at its openai_base_url (<server>/s/<session_id>/v1) or the "
        "Anthropic SDK at its anthropic_base_url (<server>/s/<session_id>), with the session's api_key")


@pytest.mark.parametrize("target", TARGETS)
def test_404_and_405_in_the_wires_shape_with_a_base_url_hint(tok, stack, target):
    h, r = stack(EchoEngine(tok))
    t = h if target == "direct" else r
    info = open_session(t)
    base, s = t.base_url, f"{t.base_url}/s/{info['session_id']}"
    # an OpenAI SDK pointed at the server root + /v1: told how to open a session
    with pytest.raises(openai.NotFoundError) as ei:
        openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body == {"message": HINT.format("/v1/chat/completions"), "type": "not_found_error",
                             "param": None, "code": "not_found"}
    with pytest.raises(anthropic.NotFoundError) as ei:
        anthropic.Anthropic(base_url=base, api_key="k", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.body == {"type": "error", "error": {"type": "not_found_error", "message": HINT.format("/v1/messages"),
                                                        "details": {"error_code": "not_found"}}}
    assert_wire_error(httpx.get(f"{base}/"), "openai", 404, HINT.format("/"), None, "not_found")
    # wrong method on a session route: 405 in that route's wire shape
    key = {"x-api-key": info["api_key"]}
    assert_wire_error(httpx.get(f"{s}/v1/chat/completions", headers=key), "openai", 405,
                      f"method GET is not allowed on /s/{info['session_id']}/v1/chat/completions", None, "method_not_allowed")
    got = httpx.get(f"{s}/v1/messages", headers=key)
    assert_wire_error(got, "anthropic", 405, f"method GET is not allowed on /s/{info['session_id']}/v1/messages",
                      None, "method_not_allowed")
    assert got.json()["error"]["type"] == "invalid_request_error"
    assert_wire_error(httpx.get(f"{base}/sessions", headers={"x-api-key": "adm"}), "openai", 405,
                      "method GET is not allowed on /sessions", None, "method_not_allowed")
    assert_wire_error(httpx.post(f"{s}/v1/embeddings", headers=key, json={}), "openai", 404,
                      f"no route /s/{info['session_id']}/v1/embeddings (a session serves /v1/chat/completions, "
                      "/v1/responses, /v1/messages and /v1/models)", None, "not_found")


# ------------------------------------------------------------------ item 5: sampling fields

NON_NEUTRAL = {"presence_penalty": 0.5, "frequency_penalty": -0.2, "repetition_penalty": 1.1, "logit_bias": {"5": 10},
               "min_p": 0.05, "min_tokens": 3, "ignore_eos": True, "length_penalty": 0.5, "best_of": 2,
               "use_beam_search": True, "stop_token_ids": [7], "bad_words": ["x"], "allowed_token_ids": [1, 2],
               "response_format": {"type": "json_object"}, "reasoning_effort": "low", "thread": {"type": "create"},
               "chat_template_kwargs": {"enable_thinking": False}, "functions": [{"name": "f"}], "function_call": "auto",
               "modalities": ["text", "audio"], "audio": {"voice": "x"}, "prediction": {"type": "content"},
               "web_search_options": {}, "verbosity": "low", "skip_special_tokens": False,
               "include_stop_str_in_output": True, "echo": True, "add_generation_prompt": False,
               "continue_final_message": True, "thinking": {"type": "enabled", "budget_tokens": 1024}}
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}, "min_p": 0.0,
           "min_tokens": 0, "ignore_eos": False, "length_penalty": 1, "best_of": 1, "use_beam_search": False,
           "stop_token_ids": [], "response_format": {"type": "text"},
           "reasoning_effort": None, "modalities": ["text"], "skip_special_tokens": True, "echo": False,
           "thinking": {"type": "disabled"}}


def test_every_refused_field_is_tested_and_documented():
    assert set(NON_NEUTRAL) == set(REFUSED_OPENAI) | set(REFUSED_ANTHROPIC)
    doc = open("docs/README.md").read()
    for name in [*REFUSED_OPENAI, *REFUSED_ANTHROPIC, *IGNORED_OPENAI, *IGNORED_ANTHROPIC]:
        assert f"`{name}`" in doc, name


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", WIRES)
def test_sampling_fields_one_rule(tok, stack, wire, stream):
    eng = ScriptedEngine(tok, ["ok"] * 100)
    h, r = stack(eng)
    info = open_session(h)
    refused = REFUSED_OPENAI if wire == "openai" else REFUSED_ANTHROPIC
    for name in refused:
        got = post(info, wire, body_of(wire, **{name: NON_NEUTRAL[name]}), stream)
        code = "thread_unsupported_request" if name == "thread" else "unsupported_parameter"  # the SDK's fallback code
        msg = assert_wire_error(got, wire, 400, None, *((name, code) if wire == "openai" else (None, code)))
        assert msg.startswith(f"{name}={json.dumps(NON_NEUTRAL[name])} is not supported here: {refused[name][1]}")
        assert name == "thread" or msg[len(f"{name}={json.dumps(NON_NEUTRAL[name])} is not supported here: "
                                          f"{refused[name][1]}"):].startswith("; omit it")
    assert eng.calls == 0 and traj(h, info["session_id"]).segments == []
    # an unknown field is refused, naming it; so is one of the other wire's refused fields
    for name in ("frobnicate", "top_a"):
        got = post(info, wire, body_of(wire, **{name: 1}), stream)
        msg = assert_wire_error(got, wire, 400, None, *((name, "unknown_parameter") if wire == "openai" else (None, "unknown_parameter")))
        assert msg.startswith(f"unknown field {name!r} (sent 1): this server refuses fields it does not know; omit it. "
                              "It honours model, ")
    # neutral values, documented-ignored fields and honoured fields: 200, applied as sent
    ignored = IGNORED_OPENAI if wire == "openai" else IGNORED_ANTHROPIC
    neutral = {k: v for k, v in NEUTRAL.items() if k in refused}
    body = body_of(wire, **neutral, **{k: "x" if k != "metadata" else {"a": "b"} for k in ignored},
                   temperature=0.5, top_p=0.9, top_k=20, seed=7)
    got = post(info, wire, body, stream)
    assert got.status_code == 200, got.text
    p = eng.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (0.5, 0.9, 20, 7, 8)
    (seg,) = traj(h, info["session_id"]).segments
    assert (seg.spans[0].temperature, seg.spans[0].top_p, seg.spans[0].top_k) == (0.5, 0.9, 20)  # the trainer's transform


def test_refused_field_through_the_router(tok, stack):
    eng = ScriptedEngine(tok, ["ok"])
    h, r = stack(eng)
    info = open_session(r)
    with pytest.raises(openai.BadRequestError) as ei:
        openai.OpenAI(base_url=info["openai_base_url"], api_key=info["api_key"], max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"repetition_penalty": 1.3})
    assert ei.value.body["param"] == "repetition_penalty" and ei.value.body["code"] == "unsupported_parameter"
    with pytest.raises(anthropic.BadRequestError) as ei:
        anthropic.Anthropic(base_url=info["anthropic_base_url"], api_key=info["api_key"], max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"min_p": 0.1})
    assert ei.value.body["error"]["message"].startswith("unknown field 'min_p'")
    assert eng.calls == 0


# ------------------------------------------------------------------ item 6: tool calls

TRICKY = {"name": "write_file", "arguments": {"path": "a.md", "text": "use </tool_call> to close"}}
PARALLEL = ("I will write three files.\n"
            '<tool_call>\n{"name": "write_file", "arguments": {"path": "a.md", "text": "use </tool_call> to close"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "write_file", "arguments": {"path": "b.md", "text": "<tool_call>{\\"x\\": 1}"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "write_file", "arguments": {"path": "c.md", "text": "}}"}}\n</tool_call>')
PARALLEL_ARGS = [{"path": "a.md", "text": "use </tool_call> to close"}, {"path": "b.md", "text": '<tool_call>{"x": 1}'},
                 {"path": "c.md", "text": "}}"}]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", WIRES)
def test_tool_calls_json_aware_every_parallel_call_survives(tok, stack, wire, stream, target):
    single = f"<tool_call>\n{json.dumps(TRICKY)}\n</tool_call>"
    eng = ScriptedEngine(tok, [single, PARALLEL])
    h, r = stack(eng)
    info = open_session(h if target == "direct" else r)
    results = []
    for _ in range(2):
        msgs = [{"role": "user", "content": f"write {len(results)}"}]
        if wire == "openai":
            oc = openai.OpenAI(base_url=info["openai_base_url"], api_key=info["api_key"], max_retries=0)
            if stream:
                content, calls, finish = "", {}, None
                for ch in oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True):
                    for c in ch.choices:
                        content += c.delta.content or ""
                        for tc in c.delta.tool_calls or []:
                            calls.setdefault(tc.index, ["", ""])
                            calls[tc.index][0] += tc.function.name or ""
                            calls[tc.index][1] += tc.function.arguments or ""
                        finish = c.finish_reason or finish
                results.append((content, [(n, json.loads(a)) for n, a in calls.values()], finish))
            else:
                ch = oc.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0]
                results.append((ch.message.content, [(c.function.name, json.loads(c.function.arguments))
                                                     for c in ch.message.tool_calls], ch.finish_reason))
        else:
            ac = anthropic.Anthropic(base_url=info["anthropic_base_url"], api_key=info["api_key"], max_retries=0)
            if stream:
                with ac.messages.stream(model="m", max_tokens=400, messages=msgs, tools=A_TOOLS) as st:
                    m = st.get_final_message()
            else:
                m = ac.messages.create(model="m", max_tokens=400, messages=msgs, tools=A_TOOLS)
            text = "".join(b.text for b in m.content if b.type == "text")
            results.append((text, [(b.name, b.input) for b in m.content if b.type == "tool_use"], m.stop_reason))
    stop = "tool_calls" if wire == "openai" else "tool_use"
    empty = (None if not stream else "") if wire == "openai" else ""
    assert results[0] == (empty, [("write_file", TRICKY["arguments"])], stop)
    assert results[1] == ("I will write three files.", [("write_file", a) for a in PARALLEL_ARGS], stop)


def test_tool_parsers_per_family():
    from molt_plugins.parsers import get_tool_parser

    def calls(name, text, tools=None):
        return [(c.name, c.arguments, c.span) for c in get_tool_parser(name).parse(text, 0, tools)]

    t = f"x<tool_call>{json.dumps(TRICKY)}</tool_call>"
    assert calls("hermes", t) == [("write_file", TRICKY["arguments"], (1, len(t)))]
    # several objects in one block, an array, a block the generation ended in, a malformed block kept as text
    two = '<tool_call>{"name": "a", "arguments": {}}\n{"name": "b", "arguments": "{\\"k\\": 2}"}</tool_call>'
    assert calls("hermes", two) == [("a", {}, (0, len(two))), ("b", {"k": 2}, (0, len(two)))]
    arr = '<tool_call>[{"name": "a", "arguments": {"q": 1}}, {"name": "b", "parameters": {}}]</tool_call>'
    assert [c[:2] for c in calls("hermes", arr)] == [("a", {"q": 1}), ("b", {})]
    assert calls("hermes", '<tool_call>{"name": "a", "arguments": {}}\n') == [("a", {}, (0, 42))]  # to the end
    assert calls("hermes", '<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>') == []
    assert calls("hermes", '<tool_call>{"name": "a", "arguments": [1]}</tool_call>') == []
    coder = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.md\n</parameter>\n<parameter=text>\n"
             "see </parameter> and </tool_call>\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>")
    assert calls("qwen3_coder", "ok " + coder, TOOLS) == [
        ("write_file", {"path": "a.md", "text": "see </parameter> and </tool_call>", "n": 3}, (3, 3 + len(coder)))]
    assert calls("qwen3_coder", "<tool_call>\n<function=f>\n</tool_call>") == []
    l3 = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    assert calls("llama3_json", l3) == [("f", {"a": 1}, (0, len(l3))), ("g", {}, (0, len(l3)))]
    assert calls("llama3_json", 'Sure: {"name": "f", "parameters": {}}') == []
    mi = 'ok[TOOL_CALLS][{"name": "f", "arguments": {"a": "]"}}, {"name": "g", "arguments": {}}]'
    assert calls("mistral", mi) == [("f", {"a": "]"}, (2, len(mi))), ("g", {}, (2, len(mi)))]
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: auto, hermes, llama3_json, mistral, qwen, qwen3_coder"):
        get_tool_parser("nope")


def test_auto_tool_parser_follows_the_tokenizer():
    from types import SimpleNamespace

    from molt_plugins.parsers import (HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser,
                                      TransformersResponseParser, get_tool_parser)

    def kind(template, **kw):
        return type(get_tool_parser("auto", SimpleNamespace(chat_template=template, **kw)))

    assert [kind("{{ '<tool_call>' }}"), kind("<function={{ name }}>"), kind("[TOOL_CALLS]"), kind("<|python_tag|>")] == [
        HermesParser, Qwen3CoderParser, MistralParser, Llama3JsonParser]

    class WithSchema:  # transformers' own response schema wins
        chat_template, response_template = "<function=", {"x": 1}

        def parse_response(self, text, tools=None):
            return {"role": "assistant", "content": "Writing.",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}

    p = get_tool_parser("auto", WithSchema())
    assert type(p) is TransformersResponseParser
    text = "Writing.\n<call f a=1>"
    assert [(c.name, c.arguments, c.span) for c in p.parse(text, 0)] == [("f", {"a": 1}, (8, len(text)))]


def test_server_uses_the_configured_tool_parser(tok, stack):
    reply = '<|python_tag|>{"name": "write_file", "parameters": {"path": "p", "text": "t"}}'
    h, r = stack(ScriptedEngine(tok, [reply]), tool_parser="llama3_json")
    info = open_session(h)
    ch = openai.OpenAI(base_url=info["openai_base_url"], api_key=info["api_key"], max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "w"}], tools=TOOLS).choices[0]
    assert (ch.message.content, ch.finish_reason) == (None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("write_file", {"path": "p", "text": "t"})]


# ------------------------------------------------------------------ item 2: huge prompts


def _timed_pair(info_a, info_b, big, wire_b="anthropic"):
    """Send ``big`` to session A and, once it is on its way, a small request to session B;
    returns (A's response, A's seconds, B's response, B's seconds)."""
    out = {}

    def send_a():
        t0 = time.monotonic()
        out["a"] = post(info_a, "openai", {"model": "m", "messages": [{"role": "user", "content": big}]}, timeout=120)
        out["ta"] = time.monotonic() - t0

    th = threading.Thread(target=send_a)
    th.start()
    time.sleep(0.3)  # A's body is being sent / processed
    t0 = time.monotonic()
    out["b"] = post(info_b, wire_b, body_of(wire_b, "quick"), timeout=120)
    out["tb"] = time.monotonic() - t0
    out["a_running"] = th.is_alive()
    th.join()
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_10mb_prompt_is_refused_cheaply_and_stalls_no_other_session(tok, stack, target):
    h, r = stack(EchoEngine(tok), max_model_len=4096)
    t = h if target == "direct" else r
    a, b = open_session(t), open_session(t)
    big = "word " * (2 * 1024 * 1024)  # 10 MiB
    out = _timed_pair(a, b, big)
    assert out["b"].status_code == 200 and out["tb"] < 1.0, (out["tb"], out["ta"])
    # refused from its rendered length (10485770 + template characters, at most 16 per token) before tokenizing
    msg = assert_wire_error(out["a"], "openai", 400, None, "messages", "context_length_exceeded")
    n_chars = len(h.sessions.ledger(a["session_id"]).render([{"role": "user", "content": big}]))
    assert msg == (f"the prompt is at least {-(-n_chars // 16)} tokens ({n_chars} characters, at most 16 per token); "
                   "the model's context is 4096 tokens. Shorten the conversation (or compact it)")
    assert out["ta"] < 5.0, out["ta"]  # was ~44 s (rendered and tokenized on the event loop)
    assert traj(h, a["session_id"]).segments == []


def test_tokenizing_a_huge_prompt_runs_off_the_event_loop(tok, stack):
    # a context the 3 MB prompt fits: it is rendered and tokenized in full (~2 s here), in a worker thread
    eng = EchoEngine(tok)
    h, r = stack(eng, max_model_len=10**9)
    a, b = open_session(h), open_session(h)
    out = _timed_pair(a, b, "word " * 600_000, wire_b="openai")
    assert out["b"].status_code == 200 and out["tb"] < 1.0, (out["tb"], out["ta"])
    assert out["a"].status_code == 200 and out["a_running"] is True  # B was answered while A was still being prepared


def test_body_limit_enforced_while_reading(tok, stack):
    h, r = stack(EchoEngine(tok), max_body_bytes=1000)
    info = open_session(h)
    body = body_of("anthropic", "x" * 2000)
    got = post(info, "anthropic", body)
    n = len(json.dumps({**body, "stream": False}))
    assert n == 2095
    assert_wire_error(got, "anthropic", 413, f"request body is {n} bytes; the limit is 1000", None,
                      "request_too_large")  # refused from Content-Length
    assert got.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit trips while reading
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}]}'

    got = httpx.post(info["openai_base_url"] + "/chat/completions", content=chunks(),
                     headers={"x-api-key": info["api_key"], "content-type": "application/json"})
    assert_wire_error(got, "openai", 413, "request body exceeds the limit of 1000 bytes", None, "request_too_large")
    assert traj(h, info["session_id"]).segments == []


# ------------------------------------------------------------------ item 3: disconnects


class HangingEngine(ScriptedEngine):
    """Never finishes a generation until cancelled; records cancellations."""

    def __init__(self, tok):
        super().__init__(tok, [])
        self.started = threading.Event()
        self.cancelled = threading.Event()

    async def generate(self, prompt_ids, params):
        if self.replies:  # scripted replies are answered normally
            return await super().generate(prompt_ids, params)
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("wire", WIRES)
def test_client_disconnect_aborts_generation_and_commits_nothing(tok, stack, wire, target):
    eng = HangingEngine(tok)
    h, r = stack(eng)
    info = open_session(h if target == "direct" else r)
    with pytest.raises(httpx.ReadTimeout):
        post(info, wire, body_of(wire), timeout=1.0)  # the client gives up and closes the connection
    assert eng.started.is_set()
    assert eng.cancelled.wait(10)  # the generation was cancelled ...
    t = traj(h, info["session_id"])  # ... and no turn was committed
    assert t.segments == [] and t.info["requests"] == {"start": 0, "extend": 0, "rewrite": 0, "retry": 0}
    # the session goes on: the same request now generates (not a cached retry) and is recorded once
    eng.replies.append("Fine.")
    got = post(info, wire, body_of(wire))
    assert got.status_code == 200
    (seg,) = traj(h, info["session_id"]).segments
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == enc(tok, "Fine.") + [2]


# ------------------------------------------------------------------ item 7: retries


@pytest.mark.parametrize("wire", WIRES)
def test_identical_request_is_cached_and_no_cache_asks_for_a_fresh_sample(tok, stack, wire):
    eng = ScriptedEngine(tok, ["First.", "Second."])
    h, r = stack(eng)
    info = open_session(r)
    texts = []
    for headers in (None, None, {"Cache-Control": "no-cache"}):
        j = post(info, wire, body_of(wire), headers=headers).json()
        texts.append(j["choices"][0]["message"]["content"] if wire == "openai" else j["content"][0]["text"])
    assert texts == ["First.", "First.", "Second."] and eng.calls == 2
    t = traj(h, info["session_id"])
    assert t.info["requests"] == {"start": 1, "extend": 0, "rewrite": 1, "retry": 1}
    assert [[x for x, m in zip(s.token_ids, s.loss_mask) if m] for s in t.segments] == [
        enc(tok, "First.") + [2], enc(tok, "Second.") + [2]]


# ------------------------------------------------------------------ item 10: tool_choice none


@pytest.mark.parametrize("wire", WIRES)
def test_tool_choice_none_keeps_tools_in_the_prompt_and_the_next_turn_extends(tok, stack, wire):
    call = f"<tool_call>\n{json.dumps({'name': 'write_file', 'arguments': {'path': 'p'}})}\n</tool_call>"
    eng = ScriptedEngine(tok, [f"No tools now. {call}", call])
    h, r = stack(eng)
    info = open_session(h)
    msgs = [{"role": "user", "content": "hi"}]
    if wire == "openai":
        j = post(info, wire, {"model": "m", "messages": msgs, "tools": TOOLS, "tool_choice": "none"}).json()
        m = j["choices"][0]["message"]
        assert (m["content"], m.get("tool_calls"), j["choices"][0]["finish_reason"]) == (f"No tools now. {call}", None, "stop")
        msgs += [{"role": "assistant", "content": m["content"]}, {"role": "user", "content": "now write"}]
        j = post(info, wire, {"model": "m", "messages": msgs, "tools": TOOLS}).json()
        assert j["choices"][0]["finish_reason"] == "tool_calls"
    else:
        j = post(info, wire, {**body_of(wire, "hi"), "max_tokens": 200, "tools": A_TOOLS, "tool_choice": {"type": "none"}}).json()
        assert (j["content"], j["stop_reason"]) == ([{"type": "text", "text": f"No tools now. {call}"}], "end_turn")
        msgs += [{"role": "assistant", "content": j["content"]}, {"role": "user", "content": "now write"}]
        j = post(info, wire, {"model": "m", "max_tokens": 200, "messages": msgs, "tools": A_TOOLS}).json()
        assert j["stop_reason"] == "tool_use"
    tools = TOOLS if wire == "openai" else [{"type": "function", "function": {
        "name": "write_file", "description": "write a file", "parameters": TOOLS[0]["function"]["parameters"]}}]
    first = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True, tokenize=False)
    assert eng.prompts[0] == enc(tok, first)  # the tools were rendered under tool_choice none
    t = traj(h, info["session_id"])
    assert len(t.segments) == 1 and t.info["requests"] == {"start": 1, "extend": 1, "rewrite": 0, "retry": 0}


# ------------------------------------------------------------------ item 9: molt serve --host


def test_molt_serve_host_beyond_loopback_needs_a_key(monkeypatch):
    from click.testing import CliRunner

    import molt_core.engines.transformers_engine as te
    from molt_core.cli import _is_loopback, main

    assert [_is_loopback(x) for x in ("127.0.0.1", "127.0.0.5", "localhost", "::1", "0.0.0.0", "10.1.2.3", "::", "host")] == [
        True, True, True, True, False, False, False, False]
    monkeypatch.delenv("MOLT_ADMIN_KEY", raising=False)
    loaded = []

    def no_model(*a, **k):
        loaded.append(a)
        raise ValueError("not loaded in this test")

    monkeypatch.setattr(te, "TransformersEngine", no_model)
    r = CliRunner().invoke(main, ["serve", "--model", "builtin:tiny-qwen3", "--host", "0.0.0.0"])
    assert r.exit_code == 2 and loaded == []  # refused before any model is loaded
    assert " ".join(r.output.split()) == (
        "error: --host 0.0.0.0 listens beyond loopback: every session keeps its own key, but the admin routes need "
        "a key you chose. Pass --admin-key (or set MOLT_ADMIN_KEY), or keep the default --host 127.0.0.1")
    # with a key (flag or environment) the check passes and the model is loaded
    r = CliRunner().invoke(main, ["serve", "--model", "builtin:tiny-qwen3", "--host", "0.0.0.0", "--admin-key", "k"])
    assert r.exit_code == 2 and "--model builtin:tiny-qwen3: not loaded in this test" in " ".join(r.output.split())
    r = CliRunner().invoke(main, ["serve", "--model", "m", "--host", "0.0.0.0"], env={"MOLT_ADMIN_KEY": "k"})
    assert len(loaded) == 2
    r = CliRunner().invoke(main, ["serve", "--model", "m", "--tool-parser", "nope"])
    assert r.exit_code == 2 and "--tool-parser nope: unknown; known: auto, hermes, llama3_json, mistral, qwen, qwen3_coder" in r.output


@pytest.mark.parametrize("name,bound", [("builtin:tiny-qwen3", 16), ("builtin:tiny-qwen3-bigvocab", None)])
def test_cheap_prompt_bound_never_overestimates(name, bound):
    """The pre-tokenization bound ``ceil(chars / max_token_bytes)`` is a lower bound on the real
    token count (so the cheap check never refuses a prompt that fits), on the tiny and on the
    real Qwen2/3 BPE vocabulary, for arbitrary Unicode text."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from molt_core.ledger import max_token_bytes

    t = load_tokenizer(name)
    L = max_token_bytes(t)
    if bound is not None:
        assert L == bound
    assert max_token_bytes(t) == L  # cached per tokenizer object

    @settings(max_examples=80, deadline=None)
    @given(st.text(max_size=400) | st.text(alphabet=" \n-=#*abc", max_size=2000))
    def prop(text):
        assert len(t.encode(text, add_special_tokens=False)) >= -(-len(text) // L)

    prop()
