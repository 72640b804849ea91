"""Hypothesis fuzz of malformed requests on both wires, the admin routes and the router: every answer is a 4xx in the wire's
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
from molt_core.server.wires import ChatCompletionRequest
from molt_plugins.wires.anthropic import MessagesRequest
from molt_plugins.wires.responses import ResponsesRequest

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
    path = f"/s/{sid}/v1/" + {"openai": "chat/completions", "anthropic": "messages", "responses": "responses"}[wire]
    kw = {"content": content} if content is not None else {"content": json.dumps(body, allow_nan=True)}
    r = tc.post(path, headers={"x-api-key": info["api_key"], "content-type": "application/json"}, **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()
    if wire in ("openai", "responses"):
        assert set(err) == {"error"} and isinstance(err["error"]["message"], str) and err["error"]["message"]
    else:
        assert err["type"] == "error" and err["error"]["message"]
    after = app.state.sessions.trajectory(sid)
    assert after.segments == before.segments and eng.calls == calls
    assert tc.get(f"/s/{sid}/v1/models", headers={"x-api-key": info["api_key"]}).status_code == 200
    return r


def _valid(wire, body):
    try:
        if wire == "openai":
            normalize_messages(ChatCompletionRequest.model_validate(body).messages)
        elif wire == "responses":
            normalize_messages(ResponsesRequest.model_validate(body).openai_messages())
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
@given(wire=st.sampled_from(["openai", "anthropic", "responses"]), body=json_any)
def test_random_json(env, wire, body):
    # random JSON values: never a valid request (no messages list of the right shape)
    if isinstance(body, dict):
        body.pop("messages", None)
        body.pop("input", None)
    _check(env, wire, body)


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic", "responses"]), raw=st.binary(max_size=64))
def test_random_bytes(env, wire, raw):
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and ("messages" in obj or "input" in obj):
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


# ---------------------------------------------------------------- issue 12: more classes

lone = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
with_surrogate = st.tuples(st.text(max_size=5), lone, st.text(max_size=5)).map("".join)


def _put(body, path, value):
    """Set ``value`` at ``path`` (a list of keys / indices) inside a copy of ``body``."""
    body = json.loads(json.dumps(body))
    o = body
    for k in path[:-1]:
        o = o[k]
    o[path[-1]] = value
    return body


SURROGATE_SITES = {
    "openai": [(["messages", 0, "content"], "messages[0].content"), (["model"], "model"),
               (["stop"], "stop"), (["messages", 0, "name"], "messages[0].name")],
    "anthropic": [(["messages", 0, "content"], "messages[0].content"), (["system"], "system"),
                  (["stop_sequences"], "stop_sequences")],
}


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), data=st.data(), text=with_surrogate)
def test_lone_surrogate_anywhere_is_a_400_naming_the_field(env, wire, data, text):
    path, name = data.draw(st.sampled_from(SURROGATE_SITES[wire]))
    value = [text] if path[-1] in ("stop", "stop_sequences") else text
    body = _put(GOOD_OA if wire == "openai" else GOOD_AN, path, value)
    where = name + ("[0]" if isinstance(value, list) else "")
    r = _check(env, wire, body)
    i = next(j for j, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    assert r.json()["error"]["message"].startswith(
        f"{where} holds a lone UTF-16 surrogate (\\u{ord(text[i]):04x}) at character {i}: that is not valid Unicode text")
    if wire == "openai":
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (where, "invalid_unicode")


KNOWN = set(ChatCompletionRequest.model_fields) | set(MessagesRequest.model_fields) | {"stream"}


@FUZZ
@given(wire=st.sampled_from(["openai", "anthropic"]), name=st.text(min_size=1, max_size=12), value=json_any)
def test_unknown_top_level_field_is_refused_by_name(env, wire, name, value):
    from molt_core.server.wires import IGNORED_OPENAI, REFUSED_OPENAI
    from molt_plugins.wires.anthropic import IGNORED_ANTHROPIC, REFUSED_ANTHROPIC

    ignored, refused = (IGNORED_OPENAI, REFUSED_OPENAI) if wire == "openai" else (IGNORED_ANTHROPIC, REFUSED_ANTHROPIC)
    if name in KNOWN or name in ignored or name in refused:
        return
    body = {**(GOOD_OA if wire == "openai" else GOOD_AN), name: value}
    r = _check(env, wire, body)
    if r.json()["error"]["message"].startswith("unknown field") and wire == "openai":
        assert r.json()["error"]["param"] == name and r.json()["error"]["code"] == "unknown_parameter"


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]),
       path=st.sampled_from(["/", "/v1/chat/completions", "/v1/messages", "/v1/models", "/v1/responses", "/sessions",
                             "/sessions/{sid}", "/sessions/{sid}/trajectory", "/sessions/nope/trajectory",
                             "/s/{sid}/v1/chat/completions", "/s/{sid}/v1/messages", "/s/{sid}/v1/models", "/s/{sid}/v1/responses",
                             "/s/{sid}/v1/nope", "/s/nope/v1/messages", "/s/{sid}", "/chat/completions"]),
       body=json_any, admin=st.booleans())
def test_any_route_any_method_is_wire_shaped_and_ledger_unchanged(env, method, path, body, admin):
    tc, info, app, eng = env
    sid = info["session_id"]
    if method == "DELETE" and path == "/sessions/{sid}" and admin:
        return  # a valid close of the fixture's session
    before, calls = app.state.sessions.trajectory(sid), eng.calls
    url = path.replace("{sid}", sid)
    key = "adm" if admin else info["api_key"]
    content = None if method in ("GET", "DELETE", "OPTIONS") else json.dumps(body, allow_nan=True)
    r = tc.request(method, url, content=content, headers={"x-api-key": key, "content-type": "application/json"})
    assert r.status_code < 500, (method, url, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()
        if url.rstrip("/").endswith("/messages"):
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert set(err) == {"error"} and err["error"]["message"]
    assert app.state.sessions.trajectory(sid).segments == before.segments and eng.calls == calls


@pytest.fixture(scope="module")
def routed():
    from molt_core.server import start_server
    from molt_core.cli.router import start_router

    tok = load_tokenizer("builtin:tiny-qwen3")
    eng = ScriptedEngine(tok, ["ok"] * 10)
    h = start_server(eng, tok, admin_key="adm", max_model_len=256)
    r = start_router([h], admin_key="adm")
    info = r.create_session()
    import httpx

    with httpx.Client(base_url=r.base_url, timeout=30) as c:
        yield c, info, h, eng
    r.stop()
    h.stop()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wire=st.sampled_from(["openai", "anthropic"]), field=st.sampled_from(["content", "extra", "surrogate", "body"]),
       value=json_any, text=with_surrogate)
def test_through_the_router_only_wire_shaped_4xx_and_ledger_unchanged(routed, wire, field, value, text):
    c, info, h, eng = routed
    sid = info.session_id
    before, calls = h.trajectory(sid), eng.calls
    body = dict(GOOD_OA if wire == "openai" else GOOD_AN)
    if field == "content":
        body["messages"] = [{"role": "user", "content": value}] if not isinstance(value, str) else value
        if _valid(wire, body):  # e.g. content null or a list of text parts: a valid request
            return
    elif field == "extra":
        body["zz_unknown"] = value
    elif field == "surrogate":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body = value if not isinstance(value, dict) else {**value, "messages": None}
    path = f"/s/{sid}/v1/chat/completions" if wire == "openai" else f"/s/{sid}/v1/messages"
    r = c.post(path, content=json.dumps(body, allow_nan=True),
               headers={"x-api-key": info.api_key, "content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()
    assert (err["type"] == "error" and err["error"]["message"]) if wire == "anthropic" else err["error"]["message"]
    assert h.trajectory(sid).segments == before.segments and eng.calls == calls


GOOD_RS = {"model": "m", "input": "hi", "max_output_tokens": 4}


@FUZZ
@given(items=st.lists(json_any, min_size=1, max_size=3), text=with_surrogate, where=st.sampled_from(["items", "text"]))
def test_responses_wire_random_input_items(env, items, text, where):
    # random input items (rejected, or rarely valid -- then skipped) and lone surrogates in input text
    body = {**GOOD_RS, "input": items if where == "items" else [{"role": "user", "content": text}]}
    if where == "items" and _valid("responses", body):
        return
    r = _check(env, "responses", body)
    if where == "text":
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("input[0].content", "invalid_unicode")
