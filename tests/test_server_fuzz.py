"""Hypothesis fuzz of malformed requests on both wires: every answer is a 4xx in the wire's
error shape (never a 500, never a dead server) and the session's ledger is unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_engine import ScriptedEngine
from molt_core.models import load_tokenizer
from molt_core.ledger import normalize_messages
from molt_core.server import create_app
from molt_core.server.wires import ChatCompletionRequest, MessagesRequest

torch.set_num_threads(1)

json_leaf = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True) | st.text(max_size=20)
json_any = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=12)

GOOD_OA = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
GOOD_AN = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
# a value of the wrong type for each field (each is invalid for that field on its wire)
WRONG = {
    "messages": [None, "hi", 3, [], [{"role": "wizard"}], [{"content": "no role"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "tool"}, 7]],
    "max_tokens": ["4", 0, -1, 2.5, True, [4]],
    "temperature": ["hot", -0.1, 3.0, [1], True, float("nan")],
    "top_p": [0, 1.5, "x", False],
    "seed": [-1, 2**70, "s", 1.5],
    "stream": ["yes", 1, None and 0 or [True]],
    "tools": ["t", [1], [{"type": "function"}], [{"function": {"name": ""}}], [{"name": 5}]],
    "stop": [5, [1, 2], [""]],
    "stop_sequences": ["s", [1], [""]],
    "n": [2, 0, "1"],
    "system": [5, [{"type": "image"}]],
    "model": [5, ["m"]],
}
OA_FIELDS = ["messages", "max_tokens", "temperature", "top_p", "seed", "stream", "tools", "stop", "n", "model"]
AN_FIELDS = ["messages", "max_tokens", "temperature", "top_p", "seed", "stream", "tools", "stop_sequences", "system", "model"]


@pytest.fixture(scope="module")
def env():
    tok = load_tokenizer("builtin:tiny-qwen3")
    eng = ScriptedEngine(tok, ["ok"] * 10)
    app = create_app(eng, tok, admin_key="adm", max_model_len=256)
    with TestClient(app, raise_server_exceptions=False) as tc:
        info = tc.post("/sessions", headers={"x-api-key": "adm"}).json()
        h = {"x-api-key": info["api_key"]}
        # one committed turn per wire, so "unchanged" is checked against a non-empty ledger
        assert tc.post(f"/s/{info['session_id']}/v1/chat/completions", json=GOOD_OA, headers=h).status_code == 200
        yield tc, info, app, eng


def _check(env, wire, body=None, content=None):
    tc, info, app, eng = env
    sid = info["session_id"]
    before, calls = app.state.sessions.trajectory(sid), eng.calls
    path = f"/s/{sid}/v1/chat/completions" if wire == "openai" else f"/s/{sid}/v1/messages"
    kw = {"content": content} if content is not None else {"content": json.dumps(body, allow_nan=True)}
    r = tc.post(path, headers={"x-api-key": info["api_key"], "content-type": "application/json"}, **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()
    if wire == "openai":
        assert isinstance(err["error"]["message"], str) and err["error"]["message"]
    else:
        assert err["type"] == "error" and err["error"]["message"]
    after = app.state.sessions.trajectory(sid)
    assert after.segments == before.segments and eng.calls == calls
    assert tc.get(f"/s/{sid}/v1/models", headers={"x-api-key": info["api_key"]}).status_code == 200


def _valid(wire, body):
    try:
        if wire == "openai":
            normalize_messages(ChatCompletionRequest.model_validate(body).messages)
        else:
            normalize_messages(MessagesRequest.model_validate(body).openai_messages())
        return True
    except Exception:
        return False


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), data=st.data())
def test_wrong_typed_field(env, wire, data):
    fields = OA_FIELDS if wire == "openai" else AN_FIELDS
    field = data.draw(st.sampled_from(fields))
    value = data.draw(st.sampled_from(WRONG[field]))
    body = dict(GOOD_OA if wire == "openai" else GOOD_AN)
    body[field] = value
    _check(env, wire, body)


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), body=json_any)
def test_random_json(env, wire, body):
    # random JSON values: never a valid request (no messages list of the right shape)
    if isinstance(body, dict):
        body.pop("messages", None)
    _check(env, wire, body)


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), raw=st.binary(max_size=64))
def test_random_bytes(env, wire, raw):
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and "messages" in obj:
        return
    _check(env, wire, content=raw)


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), messages=st.lists(json_any, min_size=1, max_size=3))
def test_random_messages(env, wire, messages):
    # messages whose entries are random JSON: either rejected, or (rarely) valid -- then skip
    body = dict(GOOD_OA if wire == "openai" else GOOD_AN)
    body["messages"] = messages
    if _valid(wire, body):
        return
    _check(env, wire, body)


def test_deeply_nested_json_is_a_400(env):
    _check(env, "openai", content=b"[" * 200000)
    _check(env, "anthropic", content=b'{"messages": ' + b"[" * 200000)
