"""The loopback server driven by the real openai and anthropic SDKs (sync, async, streaming),
multi-turn with tools and a compaction step: the trajectory equals the concatenation of the
sampled ids (as returned on the wire) and the template deltas, id for id. Plus errors in
each wire's shape, retries, failures, admin routes and a load test."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from fake_engine import EchoEngine, FailingEngine, ScriptedEngine
from molt_core.identity import TokenCheck, check_tokens
from molt_core.models import load_tokenizer
from molt_core.server import create_app, start_server

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add a and b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
A_TOOLS = [{"name": "add", "description": "add a and b",
            "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def render(tok, msgs, tools=None, gen=True):
    return tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)


def delta(tok, before, after, tools=None):
    """Template ids between a committed conversation ``before`` (ending in the assistant turn,
    whose sampled ids ended with <|im_end|>) and the next request ``after``: the "\\n" that
    closes the turn, then the new messages and the generation prompt."""
    held = render(tok, before, tools, gen=False)
    full = render(tok, after, tools)
    assert full.startswith(held)
    return enc(tok, "\n" + full[len(held):])


@pytest.fixture()
def served(tok):
    handles = []

    def make(engine, **kw):
        h = start_server(engine, tok, **kw)
        handles.append(h)
        return h

    yield make
    for h in handles:
        h.stop()


def test_openai_sdk_multiturn_tools_compaction(tok, served):
    eng = ScriptedEngine(tok, ["Hello.", f"Let me add.\n{CALL}", "It is 5.", "Summary noted."])
    h = served(eng)
    info = h.create_session(group_id="g1")
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "hi"}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, temperature=0.7, seed=1)
    ids1 = r1.choices[0].token_ids
    assert r1.choices[0].message.content == "Hello." and ids1 == enc(tok, "Hello.") + [2]
    assert [x.logprob for x in r1.choices[0].logprobs.content] == pytest.approx([-0.1 - j / 1000 for j in range(len(ids1))])
    seg = enc(tok, render(tok, msgs, TOOLS)) + ids1
    before = msgs + [{"role": "assistant", "content": "Hello."}]
    msgs = before + [{"role": "user", "content": "add 2 and 3"}]
    r2 = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, max_completion_tokens=200)
    m2 = r2.choices[0].message
    assert r2.choices[0].finish_reason == "tool_calls" and m2.content == "Let me add."
    assert m2.tool_calls[0].function.name == "add" and json.loads(m2.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    seg += delta(tok, before, msgs, TOOLS) + r2.choices[0].token_ids
    before = msgs + [m2.model_dump(exclude_none=True)]
    msgs = before + [{"role": "tool", "tool_call_id": m2.tool_calls[0].id, "content": "5"}]
    r3 = c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    assert r3.choices[0].message.content == "It is 5."
    seg += delta(tok, before, msgs, TOOLS) + r3.choices[0].token_ids
    # compaction: the agent replaces its history by a summary -> a second segment
    compact = [{"role": "system", "content": "You add. Earlier: 2+3=5."}, {"role": "user", "content": "thanks"}]
    r4 = c.chat.completions.create(model="policy", messages=compact, tools=TOOLS)
    seg2 = enc(tok, render(tok, compact, TOOLS)) + r4.choices[0].token_ids

    traj = h.trajectory(info.session_id, reward=1.0)
    assert [s.token_ids for s in traj.segments] == [seg, seg2]
    assert traj.rollout_id == info.rollout_id and traj.group_id == "g1" and traj.reward == 1.0
    assert check_tokens(traj) == TokenCheck(0, 0)  # every action token is what the engine sampled
    assert traj.info["requests"] == {"start": 1, "extend": 2, "rewrite": 1, "retry": 0}
    sampled = [t for s in traj.segments for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == ids1 + r2.choices[0].token_ids + r3.choices[0].token_ids + r4.choices[0].token_ids
    assert traj.segments[0].spans[0].temperature == 0.7 and eng.params[0].seed == 1
    assert eng.prompts[1] == seg[: len(eng.prompts[1])]  # the engine saw exactly the ledger's ids


def test_anthropic_sdk_multiturn_tool_use(tok, served):
    eng = ScriptedEngine(tok, [f"<think>\nneed a tool\n</think>\n\nCalling.\n{CALL}", "Five."])
    h = served(eng)
    info = h.create_session()
    c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    r1 = c.messages.create(model="policy", max_tokens=200, system="You add.", tools=A_TOOLS, messages=msgs)
    assert r1.stop_reason == "tool_use"
    assert [b.type for b in r1.content] == ["thinking", "text", "tool_use"]
    assert r1.content[0].thinking == "need a tool" and r1.content[2].input == {"a": 2, "b": 3}
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
             for t in A_TOOLS]
    sys_msgs = [{"role": "system", "content": "You add."}, *msgs]
    seg = enc(tok, render(tok, sys_msgs, tools)) + r1.token_ids
    msgs = msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r1.content[2].id, "content": "5"}]}]
    r2 = c.messages.create(model="policy", max_tokens=50, system="You add.", tools=A_TOOLS, messages=msgs)
    assert r2.content[0].text == "Five." and r2.stop_reason == "end_turn"
    before = sys_msgs + [{"role": "assistant", "content": f"<think>\nneed a tool\n</think>\n\nCalling.",
                          "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    after = before + [{"role": "tool", "content": "5"}]
    seg += delta(tok, before, after, tools) + r2.token_ids
    (s,) = h.trajectory(info.session_id).segments
    assert s.token_ids == seg


def test_async_and_streaming_both_wires(tok, served):
    eng = ScriptedEngine(tok, [f"Adding.\n{CALL}", "Done: 5.", "<think>\nhm\n</think>\n\nYes.", f"{CALL}"])
    h = served(eng)
    info = h.create_session()

    async def main():
        oc = openai.AsyncOpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "add"}]
        stream = await oc.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stream=True,
                                                  stream_options={"include_usage": True})
        text, calls, ids, finish, usage = "", {}, [], None, None
        async for ch in stream:
            if ch.usage:
                usage = ch.usage
            for ce in ch.choices:
                text += ce.delta.content or ""
                ids += (ce.model_extra or {}).get("token_ids", [])
                for tc in ce.delta.tool_calls or []:
                    calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
                finish = ce.finish_reason or finish
        assert (text, finish) == ("Adding.", "tool_calls") and usage.completion_tokens == len(ids)
        assert ids == eng.output(f"Adding.\n{CALL}", __import__("molt_core.types").types.SamplingParams(), 0).token_ids
        msgs += [{"role": "assistant", "content": text, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]
        r = await oc.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r.choices[0].message.content == "Done: 5."
        ac = anthropic.AsyncAnthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
        amsgs = [{"role": "user", "content": "add"},
                 {"role": "assistant", "content": [{"type": "text", "text": "Adding."},
                                                   {"type": "tool_use", "id": calls[0]["id"], "name": "add", "input": {"a": 2, "b": 3}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0]["id"], "content": "5"}]},
                 {"role": "assistant", "content": "Done: 5."},
                 {"role": "user", "content": "sure?"}]
        async with ac.messages.stream(model="policy", max_tokens=64, messages=amsgs, tools=A_TOOLS) as st:
            final = await st.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "Yes."
        amsgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                  {"role": "user", "content": "again"}]
        async with ac.messages.stream(model="policy", max_tokens=64, messages=amsgs, tools=A_TOOLS) as st:
            final2 = await st.get_final_message()
        assert final2.content[0].type == "tool_use" and final2.content[0].input == {"a": 2, "b": 3}
        return final, final2

    final, final2 = asyncio.run(main())
    traj = h.trajectory(info.session_id)
    # one wire's history continues on the other (extend); the last request follows a turn
    # with a think block by a new user turn, so the template drops it: a new segment (B03)
    assert traj.info["requests"] == {"start": 1, "extend": 2, "rewrite": 1, "retry": 0}
    seg1, seg2 = traj.segments
    ids1, ids2 = final.model_extra["token_ids"], final2.model_extra["token_ids"]
    assert seg1.token_ids[-len(ids1):] == ids1 and all(seg1.loss_mask[-len(ids1):])
    assert seg2.token_ids[-len(ids2):] == ids2 and sum(seg2.loss_mask) == len(ids2)
    assert "<think>" in tok.decode(seg1.token_ids) and "<think>" not in tok.decode(seg2.token_ids)


def test_retry_answered_from_cache(tok, served):
    eng = ScriptedEngine(tok, ["First.", "Second."])
    h = served(eng)
    info = h.create_session()
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    r1 = c.chat.completions.create(model="m", messages=msgs, seed=3)
    t1 = h.trajectory(info.session_id)
    r2 = c.chat.completions.create(model="m", messages=msgs, seed=3)
    assert r2.choices[0].token_ids == r1.choices[0].token_ids and eng.calls == 1
    assert h.trajectory(info.session_id).segments == t1.segments


@pytest.fixture()
def client(tok):
    eng = ScriptedEngine(tok, ["A."] * 100)
    app = create_app(eng, tok, admin_key="adm", max_model_len=128)
    with TestClient(app) as tc:
        info = tc.post("/sessions", headers={"Authorization": "Bearer adm"}).json()
        yield tc, info, app, eng


def test_errors_have_each_wires_shape(client):
    tc, info, app, eng = client
    sid, key = info["session_id"], info["api_key"]
    oa, an = f"/s/{sid}/v1/chat/completions", f"/s/{sid}/v1/messages"
    ok_oa = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ok_an = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    bearer = {"Authorization": f"Bearer {key}"}

    r = tc.post("/s/nope/v1/chat/completions", json=ok_oa, headers=bearer)
    assert r.status_code == 404 and "unknown session" in r.json()["error"]["message"]
    r = tc.post("/s/nope/v1/messages", json=ok_an, headers={"x-api-key": key})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = tc.post(oa, json=ok_oa, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = tc.post(an, json=ok_an)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = tc.post(oa, content=b"{not json", headers=bearer)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = tc.post(oa, json={**ok_oa, "temperature": "hot"}, headers=bearer)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = tc.post(oa, json={**ok_oa, "n": 2}, headers=bearer)
    assert r.status_code == 400 and "n=2 is not supported" in r.json()["error"]["message"]
    r = tc.post(oa, json={**ok_oa, "logprobs": True, "top_logprobs": 2}, headers=bearer)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = tc.post(oa, json={**ok_oa, "max_tokens": True}, headers=bearer)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = tc.post(oa, json={"model": "m", "messages": [{"role": "robot", "content": "x"}]}, headers=bearer)
    assert r.status_code == 400 and "messages[0].role" in r.json()["error"]["message"]
    r = tc.post(an, json={"model": "m", "messages": ok_an["messages"]}, headers={"x-api-key": key})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"] and r.json()["type"] == "error"
    r = tc.post(an, json={**ok_an, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, headers=bearer)
    assert r.status_code == 400 and "messages[0].content[0].source.type: an image block's source must be" \
        in r.json()["error"]["message"] and r.json()["type"] == "error"
    r = tc.post(an, json={**ok_an, "messages": [{"role": "user", "content": [{"type": "document"}]}]}, headers=bearer)
    assert r.status_code == 400 and "unsupported block type 'document'" in r.json()["error"]["message"]
    long = {"model": "m", "messages": [{"role": "user", "content": "word " * 400}]}
    r = tc.post(oa, json=long, headers=bearer)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "the model's context is 128 tokens" in r.json()["error"]["message"]
    assert app.state.sessions.trajectory(sid).segments == [] and eng.calls == 0
    # the server still answers, and a good request works
    r = tc.post(oa, json=ok_oa, headers=bearer)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "A."
    assert tc.get(f"/s/{sid}/v1/models", headers=bearer).json()["data"][0]["id"] == "policy"


def test_admin_routes(client):
    tc, info, app, _ = client
    sid = info["session_id"]
    assert info["openai_base_url"].endswith(f"/s/{sid}/v1") and info["anthropic_base_url"].endswith(f"/s/{sid}")
    assert tc.post("/sessions").status_code == 401
    assert tc.post("/sessions", headers={"x-api-key": "adm"}, json={"rollout_id": 5}).status_code == 400
    assert tc.get(f"/sessions/{sid}/trajectory", headers={"x-api-key": info["api_key"]}).status_code == 401
    r = tc.post("/sessions", headers={"x-api-key": "adm"}, json={"rollout_id": "r-x", "group_id": "g"})
    assert r.json()["rollout_id"] == "r-x"
    tc.post(f"/s/{sid}/v1/chat/completions", headers={"x-api-key": info["api_key"]},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    t = tc.get(f"/sessions/{sid}/trajectory", headers={"Authorization": "Bearer adm"}).json()
    assert t["rollout_id"] == info["rollout_id"] and t["segments"][0]["token_ids"][-3:] == enc(app.state.sessions.tokenizer, "A.") + [2]
    assert t["segments"][0]["loss_mask"].count(True) == 3
    assert tc.delete(f"/sessions/{sid}", headers={"x-api-key": "adm"}).json() == {"session_id": sid, "deleted": True}
    assert tc.get(f"/sessions/{sid}/trajectory", headers={"x-api-key": "adm"}).status_code == 404
    assert tc.delete(f"/sessions/{sid}", headers={"x-api-key": "adm"}).status_code == 404


def test_engine_failure_appends_nothing(tok):
    app = create_app(FailingEngine(tok), tok, admin_key="adm")
    with TestClient(app) as tc:
        info = tc.post("/sessions", headers={"x-api-key": "adm"}).json()
        r = tc.post(f"/s/{info['session_id']}/v1/messages", headers={"x-api-key": info["api_key"]},
                    json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "engine exploded" in r.json()["error"]["message"]
        assert app.state.sessions.trajectory(info["session_id"]).segments == []


def _load(tok, h, n_sessions, n_turns):
    infos = [h.create_session() for _ in range(n_sessions)]

    async def session(i, info):
        oc = openai.AsyncOpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=120)
        ac = anthropic.AsyncAnthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=120)
        msgs, replies = [], []
        for t in range(n_turns):
            msgs.append({"role": "user", "content": f"session {i} turn {t}"})
            if t % 2 == 0:
                r = await oc.chat.completions.create(model="m", messages=msgs, max_tokens=32)
                text, ids = r.choices[0].message.content, r.choices[0].token_ids
            else:
                r = await ac.messages.create(model="m", max_tokens=32, messages=msgs)
                text, ids = r.content[0].text, r.token_ids
            msgs.append({"role": "assistant", "content": text})
            replies.append(ids)
        return replies

    async def main():
        return await asyncio.gather(*(session(i, info) for i, info in enumerate(infos)))

    all_replies = asyncio.run(main())
    for i, (info, replies) in enumerate(zip(infos, all_replies)):
        traj = h.trajectory(info.session_id)
        (seg,) = traj.segments  # every turn extended the one segment
        text = tok.decode(seg.token_ids)
        assert all(f"session {i} turn {t}" in text for t in range(n_turns))
        assert "session" not in text.replace(f"session {i} turn", "")  # none mixed up
        sampled = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
        assert sampled == [t for r in replies for t in r]
        for sp in seg.spans:  # each reply names its own prompt: length and checksum
            assert tok.decode(seg.token_ids[sp.start:sp.end]) == f"len {sp.start} sum {sum(seg.token_ids[:sp.start]) % 9973}<|im_end|>"
        assert check_tokens(traj) == TokenCheck(0, 0)  # every action token is what the engine sampled
    # the server still answers
    info = h.create_session()
    r = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "still there?"}])
    assert r.choices[0].finish_reason == "stop"


def test_load_64_sessions_5_turns_both_wires(tok, served):
    _load(tok, served(EchoEngine(tok)), 64, 5)


def test_stop_strings_both_wires(tok, served):
    eng = ScriptedEngine(tok, ["Result: 5 END extra", "Value 7 STOP more"])
    h = served(eng)
    info = h.create_session()
    r = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a"}], stop="END")
    assert r.choices[0].message.content == "Result: 5" and r.choices[0].finish_reason == "stop"
    assert tok.decode(r.choices[0].token_ids).endswith("END")  # the sampled ids are kept whole
    a = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0).messages.create(
        model="m", max_tokens=30, stop_sequences=["STOP"],
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "Result: 5"}, {"role": "user", "content": "b"}])
    assert (a.content[0].text, a.stop_reason, a.stop_sequence) == ("Value 7", "stop_sequence", "STOP")
    (seg,) = h.trajectory(info.session_id).segments
    # no stop token was sampled in turn 1: the whole "<|im_end|>\n" close follows its ids
    i = len(eng.prompts[0]) + len(r.choices[0].token_ids)
    assert seg.token_ids[i:i + 2] == enc(tok, "<|im_end|>\n") and not any(seg.loss_mask[i:i + 2])


def test_concurrent_requests_on_one_session_serialize(tok, served):
    eng = EchoEngine(tok)
    h = served(eng)
    info = h.create_session()

    async def main():
        oc = openai.AsyncOpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
        return await asyncio.gather(*(oc.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
                                      for i in range(6)))

    rs = asyncio.run(main())
    traj = h.trajectory(info.session_id)
    assert len(traj.segments) == 6  # six unrelated conversations: one segment each, none lost
    assert sorted(tuple(s.token_ids[s.spans[0].start:]) for s in traj.segments) == sorted(tuple(r.choices[0].token_ids) for r in rs)


def test_ledger_generate_for_env_loop(tok):
    from molt_core.ledger import Ledger
    from molt_core.types import SamplingParams

    eng = ScriptedEngine(tok, ["One.", "Two."])
    led = Ledger(tok, rollout_id="r-env", group_id="g")
    msgs = [{"role": "user", "content": "a"}]
    t1 = asyncio.run(led.generate(eng, msgs, params=SamplingParams(max_tokens=50), max_model_len=64))
    assert t1.content == "One." and eng.params[0].stop_token_ids == led.stop_token_ids
    assert eng.params[0].max_tokens == min(50, 64 - len(eng.prompts[0]))
    asyncio.run(led.generate(eng, msgs + [{"role": "assistant", "content": t1.content}, {"role": "user", "content": "b"}]))
    traj = led.trajectory(reward=2.0)
    assert traj.rollout_id == "r-env" and len(traj.segments) == 1 and traj.info["requests"]["extend"] == 1
    with pytest.raises(ValueError, match="the model's context is 8 tokens"):
        asyncio.run(led.generate(eng, [{"role": "user", "content": "long " * 50}], max_model_len=8))


def test_broken_engine_output_is_a_500_in_wire_shape_and_records_nothing(tok):
    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids, params):
            return object()  # not a GenerationOutput

    app = create_app(Broken(tok), tok, admin_key="adm")
    with TestClient(app, raise_server_exceptions=False) as tc:
        info = tc.post("/sessions", headers={"x-api-key": "adm"}).json()
        h = {"x-api-key": info["api_key"]}
        r = tc.post(f"/s/{info['session_id']}/v1/messages", headers=h,
                    json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        assert app.state.sessions.trajectory(info["session_id"]).segments == []
        assert tc.get(f"/s/{info['session_id']}/v1/models", headers=h).status_code == 200


def test_session_trajectory_truncated_when_any_turn_was_cut(client):
    """Issue 10 item 9, server path: ``GET /sessions/{sid}/trajectory`` reports truncated once
    any generation of the session ended with finish reason ``length``, even when the last one
    stopped normally; a session whose turns all stopped is not truncated."""
    tc, info, app, eng = client
    tok = app.state.sessions.tokenizer
    adm = {"Authorization": "Bearer adm"}
    new = tc.post("/sessions", headers=adm).json()
    for sess, first in ((info, enc(tok, " one two three four five")), (new, ".")):  # "." + the stop id: 2 ids
        eng.replies[:2] = [first, "Done."]
        head = {"Authorization": f"Bearer {sess['api_key']}"}
        url = f"/s/{sess['session_id']}/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        r1 = tc.post(url, json={"model": "m", "messages": msgs, "max_tokens": 2}, headers=head).json()
        msgs += [r1["choices"][0]["message"], {"role": "user", "content": "and?"}]
        r2 = tc.post(url, json={"model": "m", "messages": msgs}, headers=head).json()
        sess["finish"] = [r1["choices"][0]["finish_reason"], r2["choices"][0]["finish_reason"]]
        sess["traj"] = tc.get(f"/sessions/{sess['session_id']}/trajectory", headers=adm).json()
    assert info["finish"] == ["length", "stop"] and new["finish"] == ["stop", "stop"]
    assert info["traj"]["truncated"] is True and info["traj"]["info"]["length_cut_turns"] == 1
    assert new["traj"]["truncated"] is False and new["traj"]["info"]["length_cut_turns"] == 0
    assert info["traj"]["info"]["requests"]["extend"] == 1  # the cut turn was extended, not rewritten


#: ids the builtin tiny Qwen3 sampled in the server load benchmark (issue 24 item 9), cut at
#: max_tokens 16: "\ufffd\ufffd\x1d<tool_call> e6ction?\x14s<think>9 anction\ufffd so" -- partial
#: UTF-8 bytes (U+FFFD), a stray <tool_call> and an unclosed <think> (id 3), so the reply's
#: content is "" and its reasoning "9 anction\ufffd so"
LOAD_IDS = [165, 173, 226, 5, 435, 30, 323, 39, 217, 91, 3, 33, 344, 323, 133, 494]


def _ask_and_echo(info, wire, msgs, stream):
    """One 16-token request on ``wire`` through its SDK; returns (the reply's text, its
    token_ids, ``msgs`` + the reply echoed as received: non-streamed the SDK's own objects
    (Responses output items, Anthropic content blocks), streamed the text the deltas spelled,
    as the load client sends it back)."""
    oc = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    if wire == "openai":
        if not stream:
            r = oc.chat.completions.create(model="policy", messages=msgs, max_tokens=16)
            text, ids = r.choices[0].message.content, r.choices[0].token_ids
        else:
            text, ids = "", []
            for ch in oc.chat.completions.create(model="policy", messages=msgs, max_tokens=16, stream=True):
                for ce in ch.choices:
                    text += ce.delta.content or ""
                    ids += (ce.model_extra or {}).get("token_ids", [])
        return text, ids, msgs + [{"role": "assistant", "content": text}]
    if wire == "responses":
        if not stream:
            r = oc.responses.create(model="policy", input=msgs, max_output_tokens=16)
            return r.output_text, r.model_extra["token_ids"], msgs + [o.model_dump(exclude_none=True) for o in r.output]
        events = list(oc.responses.create(model="policy", input=msgs, max_output_tokens=16, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        return text, events[-1].response.model_extra["token_ids"], msgs + [{"role": "assistant", "content": text}]
    ac = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
    if not stream:
        r = ac.messages.create(model="policy", max_tokens=16, messages=msgs)
        text = "".join(b.text for b in r.content if b.type == "text")
        return text, r.model_extra["token_ids"], msgs + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}]
    with ac.messages.stream(model="policy", max_tokens=16, messages=msgs) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    return text, final.model_extra["token_ids"], msgs + [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("wire", ["openai", "responses", "anthropic"])
def test_echoed_reply_with_unclosed_think_extends_on_every_wire(tok, served, wire, stream):
    """Issue 24 item 9: the load client sends each reply back exactly as received, yet a reply
    whose sampled ids hold an unclosed ``<think>`` (its content "" on the wire, the committed
    text not) sealed the segment and re-encoded the context. Matched against the reply the wire
    sent, it extends: one segment, id for id prompt + sampled + tail + sampled, nothing
    re-encoded, no rewrite cause counted."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    h = served(ScriptedEngine(tok, [LOAD_IDS, "Fine."]))
    info = h.create_session()
    msgs = [{"role": "user", "content": "Step 0: what is 0 + 1?"}]
    text, ids1, msgs = _ask_and_echo(info, wire, msgs, stream)
    assert (text, ids1) == ("", LOAD_IDS)
    text2, ids2, _ = _ask_and_echo(info, wire, msgs + [{"role": "user", "content": "Step 1: what is 0 + 3?"}], stream)
    assert (text2, ids2) == ("Fine.", enc(tok, "Fine.") + [im_end])
    traj = h.trajectory(info.session_id)
    assert traj.info["requests"] == {"start": 1, "extend": 1, "rewrite": 0, "retry": 0}
    assert traj.info["context_reencoded_tokens"] == 0
    assert traj.info["rewrite_causes"] == dict.fromkeys(traj.info["rewrite_causes"], 0) and len(traj.info["rewrite_causes"]) == 5
    (seg,) = traj.segments
    # the cut turn has no <|im_end|>: the tail closes it whole
    assert seg.token_ids == (enc(tok, "<|im_start|>user\nStep 0: what is 0 + 1?<|im_end|>\n<|im_start|>assistant\n") + LOAD_IDS
                             + enc(tok, "<|im_end|>\n<|im_start|>user\nStep 1: what is 0 + 3?<|im_end|>\n<|im_start|>assistant\n")
                             + enc(tok, "Fine.") + [im_end])
    assert check_tokens(traj) == TokenCheck(0, 0)


#: a reply with reasoning and a tool call: content "Calling.", reasoning "need a tool", add(a=2, b=3)
THINK_CALL = f"<think>\nneed a tool\n</think>\n\nCalling.\n{CALL}"


def _post(info, wire, history):
    """One non-streamed request on ``wire`` (raw JSON, the tools of this module): the reply."""
    head = {"Authorization": f"Bearer {info.api_key}"}
    if wire == "openai":
        return httpx.post(f"{info.openai_base_url}/chat/completions", headers=head,
                          json={"model": "policy", "messages": history, "tools": TOOLS}).json()
    if wire == "responses":
        return httpx.post(f"{info.openai_base_url}/responses", headers=head, json={
            "model": "policy", "input": history, "tools": [{"type": "function", **t["function"]} for t in TOOLS]}).json()
    return httpx.post(f"{info.anthropic_base_url}/v1/messages", headers=head, json={
        "model": "policy", "max_tokens": 200, "tools": A_TOOLS, "messages": history}).json()


def _echo_call(wire, r, history, edit):
    """``history`` + reply ``r`` (one tool call) echoed in the wire's own shape with ``edit``
    (None, "reasoning": "need two tools", "arguments": a = 2.0) + the tool's result "5"."""
    if wire == "openai":
        m = dict(r["choices"][0]["message"])
        call = m["tool_calls"][0]
        if edit == "reasoning":
            m["reasoning_content"] = "need two tools"
        if edit == "arguments":
            m["tool_calls"] = [{**call, "function": {**call["function"], "arguments": '{"a": 2.0, "b": 3}'}}]
        return history + [m, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    if wire == "responses":
        items = [dict(o) for o in r["output"]]
        for o in items:
            if o["type"] == "reasoning" and edit == "reasoning":
                o["content"] = [{"type": "reasoning_text", "text": "need two tools"}]
            if o["type"] == "function_call" and edit == "arguments":
                o["arguments"] = '{"a": 2.0, "b": 3}'
        call_id = next(o["call_id"] for o in items if o["type"] == "function_call")
        return history + items + [{"type": "function_call_output", "call_id": call_id, "output": "5"}]
    blocks = [dict(b) for b in r["content"]]
    for b in blocks:
        if b["type"] == "thinking" and edit == "reasoning":
            b["thinking"] = "need two tools"
        if b["type"] == "tool_use" and edit == "arguments":
            b["input"] = {"a": 2.0, "b": 3}
    use = next(b["id"] for b in blocks if b["type"] == "tool_use")
    return history + [{"role": "assistant", "content": blocks},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use, "content": "5"}]}]


@pytest.mark.parametrize("edit", [None, "reasoning", "arguments"], ids=["exact", "reasoning-edited", "argument-2-to-2.0"])
@pytest.mark.parametrize("wire", ["openai", "responses", "anthropic"])
def test_an_edited_echo_is_a_rewrite_on_every_wire(tok, served, wire, edit):
    """Issue 24 item 9 review, on each wire's own carriers (``reasoning_content`` / a reasoning
    item / a thinking block; JSON-text arguments / a function_call item / a tool_use input
    object): the reply echoed as sent extends the one segment; its reasoning edited, or an
    argument 2 sent back as 2.0 (equal to 2 in Python, rendered "2.0" by the template), is a
    ``reply_edited`` rewrite: two segments, the second prompt the client's history rendered."""
    h = served(ScriptedEngine(tok, [THINK_CALL, "Five."]))
    info = h.create_session()
    q = [{"role": "user", "content": "add 2 and 3"}]
    _post(info, wire, _echo_call(wire, _post(info, wire, q), q, edit))
    traj = h.trajectory(info.session_id)
    rewrites = 0 if edit is None else 1
    assert traj.info["requests"] == {"start": 1, "extend": 1 - rewrites, "rewrite": rewrites, "retry": 0}
    assert traj.info["rewrite_causes"] == {c: (rewrites if c == "reply_edited" else 0) for c in traj.info["rewrite_causes"]}
    assert len(traj.segments) == 1 + rewrites
    if edit is not None:  # the new segment's prompt holds the client's edit, never the sampled original
        text = tok.decode(traj.segments[1].token_ids)
        assert ("need two tools" in text) == (edit == "reasoning")
        assert ('"a": 2.0' in text) == (edit == "arguments")
    assert check_tokens(traj) == TokenCheck(0, 0)
