"""Issue 12 item 8: the OpenAI Responses wire (``POST /s/{sid}/v1/responses``) driven by the real
``openai`` SDK's ``responses.create`` -- plain, streaming, function tools, multi-turn -- token-exact
through the one ledger (one segment, the engine saw exactly the ledger's ids), directly and
through the router; refused fields and malformed input items are 400s naming them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from fake_engine import ScriptedEngine
from molt_core.identity import TokenCheck, check_tokens
from molt_core.models import load_tokenizer
from molt_core.server import start_server
from molt_plugins.wires.responses import IGNORED_RESPONSES, REFUSED_RESPONSES
from molt_core.cli.router import start_router

torch.set_num_threads(1)

TOOLS = [{"type": "function", "name": "add", "description": "add a and b", "strict": True,
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"], "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "description": "add a and b",
                                                "parameters": TOOLS[0]["parameters"]}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture()
def served(tok):
    handles = []

    def make(engine, routed=False):
        h = start_server(engine, tok, admin_key="adm")
        handles.append(h)
        t = h
        if routed:
            t = start_router([h], admin_key="adm")
            handles.insert(0, t)
        return h, t.create_session()

    yield make
    for h in handles:
        h.stop()


@pytest.mark.parametrize("routed", [False, True])
def test_responses_sdk_multiturn_tools_streaming_token_exact(tok, served, routed):
    eng = ScriptedEngine(tok, [f"Let me add.\n{CALL}", "<think>\nsum\n</think>\n\nIt is 5.", "You are welcome."])
    h, info = served(eng, routed)
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    # 1: plain create with a function tool -> a message and a function call
    r1 = c.responses.create(model="m", instructions="You add.", input="add 2 and 3", tools=TOOLS, temperature=0.7)
    assert [o.type for o in r1.output] == ["message", "function_call"] and r1.status == "completed"
    assert r1.output_text == "Let me add."
    fc = r1.output[1]
    assert (fc.name, json.loads(fc.arguments)) == ("add", {"a": 2, "b": 3})
    ids1 = r1.model_extra["token_ids"]
    assert ids1 == enc(tok, f"Let me add.\n{CALL}") + [2] and r1.usage.output_tokens == len(ids1)
    msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "add 2 and 3"}]
    assert eng.prompts[0] == enc(tok, tok.apply_chat_template(msgs, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                              tokenize=False))
    # 2: the agent sends the whole input back with the tool's output
    inp = [{"role": "user", "content": "add 2 and 3"}, *[o.model_dump(exclude_none=True) for o in r1.output],
           {"type": "function_call_output", "call_id": fc.call_id, "output": "5"}]
    r2 = c.responses.create(model="m", instructions="You add.", input=inp, tools=TOOLS)
    assert [o.type for o in r2.output] == ["reasoning", "message"] and r2.output_text == "It is 5."
    assert r2.output[0].content[0].text == "sum"
    ids2 = r2.model_extra["token_ids"]
    # 3: streaming, a new user turn after the reasoning turn
    inp += [*[o.model_dump(exclude_none=True) for o in r2.output], {"role": "user", "content": "thanks"}]
    events = list(c.responses.create(model="m", instructions="You add.", input=inp, tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(9))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "You are welcome."
    final = events[-1].response
    ids3 = final.model_extra["token_ids"]
    assert final.output_text == "You are welcome." and ids3 == enc(tok, "You are welcome.") + [2]
    # the helper stream accumulates the same events (a retry of request 3: answered from the cache)
    with c.responses.stream(model="m", instructions="You add.", input=inp, tools=TOOLS) as st:
        again = st.get_final_response()
    assert again.output_text == "You are welcome." and eng.calls == 3

    traj = h.trajectory(info.session_id)
    assert check_tokens(traj) == TokenCheck(0, 0)
    sampled = [t for s in traj.segments for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == ids1 + ids2 + ids3
    # turn 2 extends turn 1; turn 3 follows a think block with a new user turn: the template drops it (B03)
    assert traj.info["requests"] == {"start": 1, "extend": 1, "rewrite": 1, "retry": 1}
    seg1 = traj.segments[0]
    assert seg1.token_ids[: len(eng.prompts[1])] == eng.prompts[1] and seg1.token_ids[len(eng.prompts[1]):] == ids2
    assert eng.prompts[1][: len(eng.prompts[0]) + len(ids1)] == eng.prompts[0] + ids1  # sampled ids never re-encoded
    assert traj.segments[0].spans[0].temperature == 0.7


def test_responses_errors_and_fields(tok, served):
    eng = ScriptedEngine(tok, ["ok"] * 4)
    h, info = served(eng)
    url = info.openai_base_url + "/responses"
    head = {"authorization": f"Bearer {info.api_key}"}

    def err(body):
        r = httpx.post(url, content=json.dumps(body), headers={**head, "content-type": "application/json"})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    e = err({"model": "m", "input": "hi", "conversation": "conv_1"})
    assert (e["param"], e["code"]) == ("conversation", "unsupported_parameter")
    assert e["message"] == ('conversation="conv_1" is not supported here: conversation objects are not supported: chain '
                            "turns with previous_response_id or send the whole conversation as input (the session's "
                            "ledger extends it); omit it")
    e = err({"model": "m", "input": "hi", "frequency_penalty": 0.5})
    assert (e["param"], e["code"]) == ("frequency_penalty", "unknown_parameter")
    e = err({"model": "m", "input": [{"type": "image_generation_call"}]})
    assert (e["param"], e["message"]) == ("input[0]", "input[0]: unsupported input item type 'image_generation_call' "
                                          "(message, function_call, function_call_output and reasoning are supported)")
    e = err({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]})
    assert e["param"] == "tools[0]"
    e = err({"model": "m", "input": [{"role": "user", "content": "a\ud800"}]})
    assert (e["param"], e["code"]) == ("input[0].content", "invalid_unicode")
    assert eng.calls == 0 and h.trajectory(info.session_id).segments == []
    ok = {"model": "m", "input": "hi", "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
          "parallel_tool_calls": True, "metadata": {"k": "v"}, "include": [], "max_output_tokens": 3}
    r = httpx.post(url, json=ok, headers=head)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "ok" and eng.params[0].max_tokens == 3
    doc = open("docs/README.md").read()
    for name in [*REFUSED_RESPONSES, *IGNORED_RESPONSES]:
        assert f"`{name}`" in doc, name
