"""Issue 24 item 8: the Responses wire continues a stored response by ``previous_response_id``
(``store``, default true) token-exactly -- the next prompt is the earlier prompt ids, the sampled
ids, then the rendered new items (the ledger extends its segment, nothing re-encoded) -- plain
and streamed, directly and through the router, through the ``openai`` SDK. An id that is not
stored in the session (unknown, another session's, ``store: false``, evicted) is a 404 in the
OpenAI error shape; instructions are not carried over (OpenAI's rule); the store is bounded
and freed with its session."""

from __future__ import annotations

import gc
import weakref

import httpx
import openai
import pytest
import torch

from fake_engine import FailingEngine, ScriptedEngine
from molt_core.identity import TokenCheck, check_tokens
from molt_plugins.vision.images import data_url
from molt_core.server import start_server
from molt_plugins.wires.response_store import ResponseStore
from molt_plugins.wires.responses import ResponsesRequest
from molt_core.server.wires import WireError
from test_server_images import png
from test_server_responses import CALL, CHAT_TOOLS, TOOLS, enc, served, tok  # noqa: F401 -- fixtures

torch.set_num_threads(1)

# Qwen3's template after the sampled <|im_end|>: the turn's "\n", a tool message as a user turn, the generation prompt
TOOL_TAIL = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
USER_TAIL = "\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n"


def client(info):
    return openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)


def final(c, stream, **kw):
    """``responses.create`` plain, or streamed and read to its last event's response."""
    if not stream:
        return c.responses.create(model="m", **kw)
    events = list(c.responses.create(model="m", stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[0].response.id == events[-1].response.id
    return events[-1].response


@pytest.mark.parametrize("routed,stream", [(False, False), (False, True), (True, False), (True, True)])
def test_previous_response_id_extends_the_segment_token_exactly(tok, served, routed, stream):
    eng = ScriptedEngine(tok, [f"Let me add.\n{CALL}", "It is 5.", "You are welcome."])
    h, info = served(eng, routed)
    c = client(info)
    r1 = final(c, stream, instructions="You add.", input="add 2 and 3", tools=TOOLS)
    assert (r1.store, r1.previous_response_id) == (True, None) and [o.type for o in r1.output] == ["message", "function_call"]
    ids1 = r1.model_extra["token_ids"]
    assert ids1 == enc(tok, f"Let me add.\n{CALL}") + [2]
    msgs = [{"role": "system", "content": "You add."}, {"role": "user", "content": "add 2 and 3"}]
    assert eng.prompts[0] == enc(tok, tok.apply_chat_template(msgs, tools=CHAT_TOOLS, add_generation_prompt=True,
                                                              tokenize=False))
    # only the tool's output is sent: the function call lives in the stored response
    out = {"type": "function_call_output", "call_id": r1.output[1].call_id, "output": "5"}
    r2 = final(c, stream, instructions="You add.", previous_response_id=r1.id, input=[out], tools=TOOLS)
    assert r2.output_text == "It is 5." and r2.previous_response_id == r1.id and r2.id != r1.id
    ids2 = r2.model_extra["token_ids"]
    assert eng.prompts[1] == eng.prompts[0] + ids1 + enc(tok, TOOL_TAIL)
    r3 = final(c, stream, instructions="You add.", previous_response_id=r2.id, input="thanks", tools=TOOLS)
    ids3 = r3.model_extra["token_ids"]
    assert eng.prompts[2] == eng.prompts[1] + ids2 + enc(tok, USER_TAIL)
    traj = h.trajectory(info.session_id)
    assert traj.info["requests"] == {"start": 1, "extend": 2, "rewrite": 0, "retry": 0}
    assert traj.info["context_reencoded_tokens"] == 0 and check_tokens(traj) == TokenCheck(0, 0)
    assert len(traj.segments) == 1 and traj.segments[0].token_ids == eng.prompts[2] + ids3
    sampled = [t for t, m in zip(traj.segments[0].token_ids, traj.segments[0].loss_mask) if m]
    assert sampled == ids1 + ids2 + ids3


def test_chained_prompts_equal_the_whole_input_path(tok, served):
    """The same conversation sent whole each turn (the stateless path) gives the same engine prompts."""
    replies = [f"Let me add.\n{CALL}", "It is 5."]
    eng_a, eng_b = ScriptedEngine(tok, replies), ScriptedEngine(tok, replies)
    ca, cb = client(served(eng_a)[1]), client(served(eng_b)[1])
    a1 = ca.responses.create(model="m", instructions="You add.", input="add 2 and 3", tools=TOOLS)
    ca.responses.create(model="m", instructions="You add.", previous_response_id=a1.id, tools=TOOLS,
                        input=[{"type": "function_call_output", "call_id": a1.output[1].call_id, "output": "5"}])
    b1 = cb.responses.create(model="m", instructions="You add.", input="add 2 and 3", tools=TOOLS, store=False)
    assert b1.store is False
    whole = [{"role": "user", "content": "add 2 and 3"}, *[o.model_dump(exclude_none=True) for o in b1.output],
             {"type": "function_call_output", "call_id": b1.output[1].call_id, "output": "5"}]
    cb.responses.create(model="m", instructions="You add.", input=whole, tools=TOOLS, store=False)
    assert eng_a.prompts == eng_b.prompts and len(eng_a.prompts[1]) > len(eng_a.prompts[0])


def test_images_in_a_stored_response_replay_id_for_id(vl):
    """A stored turn's image is held as its SHA-256 (the rollout's pool): continuing it with a
    new image item extends the one segment; ids, image runs and the engine's images equal the
    whole-input path's (whose ids tests/test_server_images.py checks by hand)."""
    tok, vp = vl

    a, b = png(42, 42, (10, 10, 10)), png(28, 28, (0, 200, 0))
    first = {"role": "user", "content": [{"type": "input_text", "text": "shade?"},
                                         {"type": "input_image", "image_url": data_url(a, "image/png")}]}
    then = {"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                        {"type": "input_image", "image_url": data_url(b, "image/png")}]}
    trajs, engines = [], []
    for chained in (True, False):
        eng = ScriptedEngine(tok, ["Dark.", "Green."])
        h = start_server(eng, tok, vision=vp)
        try:
            info = h.create_session()
            c = client(info)
            r1 = c.responses.create(model="m", input=[first])
            if chained:
                list(c.responses.create(model="m", previous_response_id=r1.id, input=[then], stream=True))
            else:
                c.responses.create(model="m", input=[first, *[o.model_dump(exclude_none=True) for o in r1.output], then])
            trajs.append(h.close_session(info.session_id))
            engines.append(eng)
        finally:
            h.stop()
    chain, whole = trajs
    assert chain.info["requests"] == whole.info["requests"] == {"start": 1, "extend": 1, "rewrite": 0, "retry": 0}
    assert len(chain.segments) == 1 and chain.segments[0].token_ids == whole.segments[0].token_ids
    assert chain.segments[0].images == whole.segments[0].images and len(chain.segments[0].images) == 2
    assert engines[0].prompts == engines[1].prompts and engines[0].images == engines[1].images == [[a], [a, b]]
    assert chain.images == whole.images and check_tokens(chain) == TokenCheck(0, 0)


def test_unknown_unstored_and_foreign_ids_are_404_and_sample_nothing(tok, served):
    eng = ScriptedEngine(tok, ["Hello.", "Hi."])
    h, info = served(eng)
    c = client(info)
    r = c.responses.create(model="m", input="hi", store=False)
    assert r.store is False
    other = h.create_session()
    foreign = client(other)
    kept = foreign.responses.create(model="m", input="hi")  # stored, but in the other session
    for rid in ("resp_nope", r.id, kept.id):
        resp = httpx.post(info.openai_base_url + "/responses", json={"model": "m", "input": "more", "previous_response_id": rid},
                          headers={"authorization": f"Bearer {info.api_key}"})
        assert resp.status_code == 404
        assert resp.json() == {"error": {
            "message": f"Previous response with id {rid!r} not found in this session (a response is stored unless "
                       "created with store=false; a session keeps its last 64). Send the whole conversation as input "
                       "instead",
            "type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found"}}
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="m", input="more", previous_response_id="resp_nope", stream=True)
    assert eng.calls == 2 and h.trajectory(info.session_id).info["requests"]["start"] == 1
    resp = httpx.post(info.openai_base_url + "/responses", json={"model": "m", "input": "x", "store": "yes"},
                      headers={"authorization": f"Bearer {info.api_key}"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "store"


@pytest.mark.parametrize("stream", [False, True])
def test_repeating_a_stored_item_is_a_400_as_at_openai(tok, served, stream):
    """OpenAI answers an input item whose ``id`` the previous response already holds (one of its
    output items, or an item of the input it continued) with 400 ``Duplicate item found with id
    <id>`` (param ``input``, type ``invalid_request_error``, code null; openai-agents-python issue
    1789) instead of running a conversation holding that item twice. Items without ids, and new
    ids, continue as before."""
    eng = ScriptedEngine(tok, [f"Let me add.\n{CALL}", "It is 5.", "Bye."])
    h, info = served(eng)
    c = client(info)
    r1 = c.responses.create(model="m", input=[{"type": "message", "role": "user", "id": "msg_u1",
                                               "content": [{"type": "input_text", "text": "add 2 and 3"}]}], tools=TOOLS)
    out = {"type": "function_call_output", "call_id": r1.output[1].call_id, "output": "5"}
    headers = {"authorization": f"Bearer {info.api_key}"}
    for i, item in enumerate(r1.output):  # the agent re-sends the model's items with the tool's output
        body = {"model": "m", "previous_response_id": r1.id, "tools": TOOLS, "stream": stream,
                "input": [item.model_dump(exclude_none=True), out]}
        resp = httpx.post(info.openai_base_url + "/responses", json=body, headers=headers)
        assert resp.status_code == 400
        assert resp.json() == {"error": {
            "message": f"Duplicate item found with id {item.id}. Remove duplicate items from your input and try again "
                       f"(input[0] is an item of the previous response {r1.id}: send only the new items)",
            "type": "invalid_request_error", "param": "input", "code": None}}
    assert eng.calls == 1
    r2 = final(c, stream, previous_response_id=r1.id, input=[out], tools=TOOLS)
    assert r2.output_text == "It is 5."
    with pytest.raises(openai.BadRequestError) as e:  # an item of the input r1 continued: r2 holds it too
        c.responses.create(model="m", previous_response_id=r2.id, input=[
            {"type": "message", "role": "user", "id": "msg_u1", "content": "add 2 and 3"}])
    assert e.value.body["message"].startswith("Duplicate item found with id msg_u1. ")
    final(c, stream, previous_response_id=r2.id, tools=TOOLS,
          input=[{"type": "message", "role": "user", "id": "msg_u2", "content": "ok"}])
    assert eng.calls == 3 and h.trajectory(info.session_id).info["requests"] == {
        "start": 1, "extend": 2, "rewrite": 0, "retry": 0}


def test_instructions_are_not_carried_over_and_an_older_response_branches(tok, served):
    """OpenAI: the previous response's instructions are not carried over. Without them the
    prompt differs from the held one at its first message: a rewrite (a new segment) rendering
    the stored items; continuing an older response than the latest is a rewrite too."""
    eng = ScriptedEngine(tok, ["Hello.", "Again.", "Other."])
    h, info = served(eng)
    c = client(info)
    r1 = c.responses.create(model="m", instructions="Be brief.", input="hi")
    c.responses.create(model="m", previous_response_id=r1.id, input="more")
    expect = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "more"}]
    assert eng.prompts[1] == enc(tok, tok.apply_chat_template(expect, add_generation_prompt=True, tokenize=False))
    c.responses.create(model="m", instructions="Be brief.", previous_response_id=r1.id, input="else")
    expect = [{"role": "system", "content": "Be brief."}, *expect[:2], {"role": "user", "content": "else"}]
    assert eng.prompts[2] == enc(tok, tok.apply_chat_template(expect, add_generation_prompt=True, tokenize=False))
    traj = h.trajectory(info.session_id)
    assert traj.info["requests"] == {"start": 1, "extend": 0, "rewrite": 2, "retry": 0} and len(traj.segments) == 3


def test_retry_failure_and_session_delete(tok, served):
    """A repeated continuation is answered from the cached turn under a new id that can be
    continued too; a failed generation stores nothing; deleting the session frees its store."""
    eng = ScriptedEngine(tok, ["Hello.", "Again.", "Third."])
    h, info = served(eng)
    c = client(info)
    r1 = c.responses.create(model="m", input="hi")
    a = c.responses.create(model="m", previous_response_id=r1.id, input="more")
    b = c.responses.create(model="m", previous_response_id=r1.id, input="more")
    assert (b.output_text, eng.calls) == ("Again.", 2) and b.id != a.id
    c.responses.create(model="m", previous_response_id=b.id, input="next")
    assert h.trajectory(info.session_id).info["requests"] == {"start": 1, "extend": 2, "rewrite": 0, "retry": 1}
    store = h.sessions._get(info.session_id).responses
    assert len(store) == 4
    ref = weakref.ref(store)
    del store
    r = httpx.delete(f"{h.base_url}/sessions/{info.session_id}", headers={"authorization": "Bearer adm"})
    assert r.status_code == 200
    gc.collect()
    assert ref() is None

    bad, info2 = served(FailingEngine(tok))
    c2 = client(info2)
    with pytest.raises(openai.APIStatusError) as e:
        c2.responses.create(model="m", input="hi")
    assert e.value.status_code == 503 and len(bad.sessions._get(info2.session_id).responses) == 0


def test_store_is_bounded_lru_and_shares_messages():
    store = ResponseStore(max_items=2)
    req = ResponsesRequest(input="x", instructions="sys")
    h1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}]
    store.record(req, h1, {"id": "r1", "output": [{"id": "msg_1"}]})
    h2 = [dict(m) for m in h1] + [{"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]
    store.record(ResponsesRequest(input=[{"role": "user", "content": "b", "id": "u2"}], instructions="sys",
                                  previous_response_id="r1"), h2, {"id": "r2", "output": [{"id": "msg_2"}]})
    cont = store.continued(ResponsesRequest(input="c", previous_response_id="r2", instructions="new"),
                           [{"role": "system", "content": "new"}, {"role": "user", "content": "c"}])
    assert cont == [{"role": "system", "content": "new"}, *h2[1:], {"role": "user", "content": "c"}]
    assert cont[1] is store.continued(ResponsesRequest(input="c", previous_response_id="r1"), [])[0]  # shared, not copied
    for rid, held in (("r2", ("msg_1", "u2", "msg_2")), ("r1", ("msg_1",))):  # r2 holds r1's items, its input's, its own
        for item_id in held:
            with pytest.raises(WireError) as e:
                store.continued(ResponsesRequest(input=[{"role": "user", "content": "c", "id": item_id}],
                                                 previous_response_id=rid), [])
            assert (e.value.status, e.value.param) == (400, "input")
    assert store.continued(ResponsesRequest(input=[{"role": "user", "content": "c", "id": "u2"}],
                                            previous_response_id="r1"), []) == list(h1[1:])
    store.record(ResponsesRequest(input="y"), [{"role": "user", "content": "y"}, {"role": "assistant", "content": "Y"}],
                 {"id": "r3", "output": []})
    assert len(store) == 2  # r2 was the least recently used (r1 was read last)
    with pytest.raises(WireError) as e:
        store.continued(ResponsesRequest(input="c", previous_response_id="r2"), [])
    assert (e.value.status, e.value.param, e.value.code) == (404, "previous_response_id", "previous_response_not_found")
    assert store.continued(ResponsesRequest(input="z", previous_response_id="r3"), [{"role": "user", "content": "z"}]) == [
        {"role": "user", "content": "y"}, {"role": "assistant", "content": "Y"}, {"role": "user", "content": "z"}]
    store.record(ResponsesRequest(input="q", store=False), h1, {"id": "r4", "output": []})
    assert len(store) == 2 and "r4" not in store._items
    with pytest.raises(ValueError, match="max_items must be at least 1"):
        ResponseStore(0)
