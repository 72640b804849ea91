"""Issue 27 items 3-5 on the loopback server's wires, driven by the stock openai and anthropic SDKs:
``parallel_tool_calls: false`` stops sampling after the first complete call (a stop token, the ids
exactly the sampled ones); the Anthropic ``thread`` field is refused with the detail the SDK's tool
runner falls back on; ``tool_result.is_error`` reaches the model; refusals repeat the value sent."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
import torch

from fake_engine import ScriptedEngine
from molt_core.models import load_tokenizer
from molt_core.server import start_server
from molt_core.server.wires import shown

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "add", "input_schema": TOOLS[0]["function"]["parameters"]}]
R_TOOLS = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]
TWO = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
       '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


@pytest.fixture()
def make(tok):
    handles = []

    def mk(replies, **kw):
        eng = ScriptedEngine(tok, replies)
        h = start_server(eng, tok, **kw)
        handles.append(h)
        return h, eng, h.create_session()

    yield mk
    for h in handles:
        h.stop()


def _send(wire, info, parallel, stream=False):
    if wire == "chat":
        c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        out = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "add"}], tools=TOOLS,
                                        max_tokens=200, stream=stream, **kw)
        return list(out) if stream else out
    if wire == "responses":
        c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        return c.responses.create(model="m", input="add", tools=R_TOOLS, max_output_tokens=200, **kw)
    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    choice = {"type": "auto"} if parallel is None else {"type": "auto", "disable_parallel_tool_use": not parallel}
    return c.messages.create(model="m", max_tokens=200, messages=[{"role": "user", "content": "add"}], tools=A_TOOLS,
                             tool_choice=choice)


def _calls(wire, out):
    if wire == "chat":
        return [(c.function.name, json.loads(c.function.arguments)) for c in out.choices[0].message.tool_calls], \
            out.choices[0].finish_reason
    if wire == "responses":
        return [(i.name, json.loads(i.arguments)) for i in out.output if i.type == "function_call"], out.status
    return [(b.name, b.input) for b in out.content if b.type == "tool_use"], out.stop_reason


FINISH = {"chat": "tool_calls", "responses": "completed", "anthropic": "tool_use"}


@pytest.mark.parametrize("wire", ["chat", "responses", "anthropic"])
def test_one_call_stops_sampling_after_the_first_call(tok, make, wire):
    h, eng, info = make([TWO, TWO])
    close = tok.encode("</tool_call>", add_special_tokens=False)
    assert close == [6]  # the tiny Qwen3 tokenizer's </tool_call> is one token, as Qwen's is
    out = _send(wire, info, False)
    assert _calls(wire, out) == ([("add", {"a": 1, "b": 2})], FINISH[wire])
    assert 6 in eng.params[-1].stop_token_ids
    first = tok.encode(TWO[: TWO.index("</tool_call>")], add_special_tokens=False) + [6]
    (seg,) = h.trajectory(info.session_id).segments
    sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
    assert sampled == first  # exactly the sampled ids, ending on the stop token; nothing after it was generated
    if wire == "responses":
        assert out.parallel_tool_calls is False
    # parallel allowed (true, or absent): no extra stop, both calls
    out = _send(wire, h.create_session(), True)
    assert _calls(wire, out)[0] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert 6 not in eng.params[-1].stop_token_ids


def test_one_call_next_turn_extends_the_segment(tok, make):
    h, eng, info = make([TWO, "3"])
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "add"}]
    out = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    m = out.choices[0].message
    msgs += [{"role": "assistant", "content": m.content, "tool_calls": [tc.model_dump() for tc in m.tool_calls]},
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
    c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    (seg,) = h.trajectory(info.session_id).segments  # one segment: the stop on </tool_call> extends like any stop
    assert h.sessions.ledger(info.session_id).counts["extend"] == 1
    text = tok.decode(seg.token_ids)
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response>" in text


def test_one_call_refused_where_no_token_closes_a_call(make):
    h, eng, info = make(["x"], tool_parser="llama3_json")
    r = httpx.post(info.openai_base_url + "/chat/completions", headers={"x-api-key": info.api_key},
                   json={"messages": [{"role": "user", "content": "add"}], "tools": TOOLS, "parallel_tool_calls": False})
    assert r.status_code == 400 and r.json() == {"error": {
        "message": "parallel_tool_calls=false is not supported for this model's tool-call syntax (Llama3JsonParser): "
                   "no one-token tag closes a call, so sampling cannot stop after the first one; omit "
                   "parallel_tool_calls (every call the model writes is returned)",
        "type": "invalid_request_error", "param": "parallel_tool_calls", "code": "unsupported_value"}}
    # without tools nothing can be called: false is honoured trivially
    r = httpx.post(info.openai_base_url + "/chat/completions", headers={"x-api-key": info.api_key},
                   json={"messages": [{"role": "user", "content": "add"}], "parallel_tool_calls": False})
    assert r.status_code == 200 and eng.calls == 1


def test_thread_refused_with_the_sdk_fallback_code(make):
    h, eng, info = make(["x"])
    r = httpx.post(info.anthropic_base_url + "/v1/messages", headers={"x-api-key": info.api_key},
                   json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                         "thread": {"type": "create"}})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": 'thread={"type": "create"} is not supported here: message threads are not kept (the session\'s '
                   "ledger holds the conversation); send the whole conversation in messages without thread",
        "details": {"error_code": "thread_unsupported_request"}}}
    assert eng.calls == 0


def test_stock_tool_runner_falls_back_and_completes(tok, make):
    if not hasattr(anthropic.Anthropic(api_key="k").beta.messages, "tool_runner"):
        pytest.skip("this anthropic SDK has no beta.messages.tool_runner")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    h, eng, info = make([call, "It is 3."])
    seen = []

    @anthropic.beta_tool
    def add(a: int, b: int) -> str:
        """Add two integers."""
        seen.append((a, b))
        return str(a + b)

    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    runner = c.beta.messages.tool_runner(model="m", max_tokens=64, tools=[add],
                                         messages=[{"role": "user", "content": "1+2?"}])
    final = runner.until_done()
    assert seen == [(1, 2)] and final.content[0].text == "It is 3."
    assert eng.calls == 2  # the refused threaded requests never reached the engine
    (seg,) = h.trajectory(info.session_id).segments
    assert "<tool_response>\n3\n</tool_response>" in tok.decode(seg.token_ids)


def _a_result(content, **extra):
    return [{"role": "user", "content": "add"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "add", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": content, **extra}]}]


@pytest.mark.parametrize("content,shown_as", [("b is missing", "Error: b is missing"), ("", "Error:"),
                                              ([{"type": "text", "text": "b is missing"}], "Error: b is missing")])
def test_is_error_reaches_the_model(tok, make, content, shown_as):
    h, eng, info = make(["ok", "ok"])
    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    c.messages.create(model="m", max_tokens=4, messages=_a_result(content, is_error=True))
    assert f"<tool_response>\n{shown_as}\n</tool_response>" in tok.decode(eng.prompts[-1])
    c.messages.create(model="m", max_tokens=4, messages=_a_result("b is missing", is_error=False))
    assert "<tool_response>\nb is missing\n</tool_response>" in tok.decode(eng.prompts[-1])


def test_is_error_not_a_boolean_is_a_400(make):
    h, eng, info = make(["ok"])
    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="m", max_tokens=4, messages=_a_result("x", is_error="yes"))
    assert e.value.body == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": 'messages[2].content[0].is_error="yes" is not a boolean: send true (a failed tool), false or omit it',
        "details": {"error_code": "invalid_value"}}}
    assert eng.calls == 0


def test_shown_cuts_at_a_json_token():
    assert shown({"type": "create"}) == '{"type": "create"}'
    v = {"words": ["alpha beta"] * 20}
    got = shown(v, 40)
    assert got == '{"words": ["alpha beta", "alpha beta", ...'
    assert shown("x" * 200, 40) == " ..."  # one token longer than the limit: nothing of it is shown


def test_refusal_repeats_the_value_with_its_code(make):
    h, eng, info = make(["ok"])
    long = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {
        "reasoning_steps_in_detail": {"type": "string"}, "final_answer_text": {"type": "string"}}}}}
    r = httpx.post(info.openai_base_url + "/chat/completions", headers={"x-api-key": info.api_key},
                   json={"messages": [{"role": "user", "content": "hi"}], "response_format": long})
    assert r.status_code == 400 and r.json() == {"error": {
        "message": 'response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": '
                   '"object", "properties": ... is not supported here: constrained decoding is not applied; omit it or send '
                   '{"type": "text"}',
        "type": "invalid_request_error", "param": "response_format", "code": "unsupported_parameter"}}
    r = httpx.post(info.openai_base_url + "/chat/completions", headers={"x-api-key": info.api_key},
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json() == {"error": {
        "message": 'tool_choice="required" is not supported: forcing a tool is not applied here; send "auto" or '
                   '"none" (or omit it) and ask for the tool in the prompt',
        "type": "invalid_request_error", "param": "tool_choice", "code": "unsupported_value"}}
    assert eng.calls == 0


def test_qwen3_coder_block_ended_by_the_stop_counts():
    from molt_plugins.parsers import ParsedCall, Qwen3CoderParser
    body = "<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n"
    p = Qwen3CoderParser()
    # the stop on </tool_call> drops it from the text: the block the text ends in after </function> counts
    assert p.parse("ok <tool_call>\n" + body) == [ParsedCall("add", {"a": 1}, (3, 3 + len("<tool_call>\n" + body)))]
    assert p.parse("ok <tool_call>\n" + body[:-13]) == []  # cut before </function>: not a call, stays content
