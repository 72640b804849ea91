"""The request router in front of two loopback servers: sessions balanced by open sessions
then load, every request of a session on its backend (session affinity), token-exact
trajectories through the router equal to going direct (real openai and anthropic SDKs,
streaming and not), unknown sessions 404 in each wire's shape, a dead backend a clean 502/503,
and ``molt serve --num-engines 2``."""

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

from fake_engine import EchoEngine
from molt_core.identity import TokenCheck, check_tokens
from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.server import start_server
from molt_core.cli.router import start_router

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


@pytest.fixture()
def stack(tok):
    """``make(engines)`` -> (router, [backend handles]); everything stopped afterwards."""
    handles = []

    def make(engines, pairs=False, **kw):
        backends = [start_server(e, tok) for e in engines]
        router = start_router([(h.base_url + "/", h.admin_key) for h in backends] if pairs else backends, **kw)
        handles.extend([router, *backends])
        return router, backends

    yield make
    for h in handles:
        h.stop()


def sampled(traj):
    return [t for s in traj.segments for t, m in zip(s.token_ids, s.loss_mask) if m]


def test_balance_and_affinity(tok, stack):
    engines = [EchoEngine(tok), EchoEngine(tok)]
    router, backends = stack(engines, admin_key="adm")
    assert router.admin_key == "adm"

    async def create_all():  # concurrent creates still spread 4/4 (a slot is reserved before awaiting)
        async with httpx.AsyncClient() as c:
            rs = await asyncio.gather(*[c.post(f"{router.base_url}/sessions", headers={"x-api-key": "adm"},
                                               json={"group_id": f"g{k}"}) for k in range(8)])
        return [r.json() for r in rs]

    infos = asyncio.run(create_all())
    sids = [i["session_id"] for i in infos]
    assert sorted(router.owner.values()) == [0, 0, 0, 0, 1, 1, 1, 1]
    for b, h in enumerate(backends):  # each backend's store holds exactly its sessions
        assert set(h.sessions._sessions) == {s for s in sids if router.owner[s] == b}
        assert router.backends[b].sessions == 4
    for i in infos:  # the URLs point at the router
        assert i["openai_base_url"] == f"{router.base_url}/s/{i['session_id']}/v1"
        assert i["anthropic_base_url"] == f"{router.base_url}/s/{i['session_id']}"

    async def session(k, i):  # two turns per session, one per wire; all 8 sessions at once
        oc = openai.AsyncOpenAI(base_url=i["openai_base_url"], api_key=i["api_key"], max_retries=0)
        ac = anthropic.AsyncAnthropic(base_url=i["anthropic_base_url"], api_key=i["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": f"session {k}"}]
        r1 = await oc.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "more"}]
        async with ac.messages.stream(model="m", max_tokens=64, messages=msgs) as st:
            r2 = await st.get_final_message()
        return i["session_id"], (r1.choices[0].token_ids + r2.model_extra["token_ids"], r2.model_extra["token_ids"],
                                 r2.content[0].text)

    async def all_sessions():
        return dict(await asyncio.gather(*[session(k, i) for k, i in enumerate(infos)]))

    wire = asyncio.run(all_sessions())
    assert [e.calls for e in engines] == [8, 8]  # 4 sessions x 2 turns each, no request strayed
    for sid in sids:
        h = backends[router.owner[sid]]
        traj = h.trajectory(sid)
        ids, ids2, text2 = wire[sid]
        assert sampled(traj) == ids and traj.info["requests"]["start"] == 1 and traj.info["requests"]["extend"] == 1
        # the engine that answered turn 2 saw this ledger's prompt (EchoEngine names its length)
        (seg,) = traj.segments
        assert text2.startswith(f"len {len(seg.token_ids) - len(ids2)} sum ")
        # the trajectory route through the router returns the owner's trajectory
        t = httpx.get(f"{router.base_url}/sessions/{sid}/trajectory", headers={"authorization": "Bearer adm"}).json()
        assert t == traj.model_dump(mode="json")

    # DELETE is forwarded and frees the slot; the next session goes to the emptier backend
    gone = [s for s in sids if router.owner[s] == 1][:2]
    for s in gone:
        r = httpx.delete(f"{router.base_url}/sessions/{s}", headers={"x-api-key": "adm"})
        assert r.status_code == 200 and r.json() == {"session_id": s, "deleted": True}
    assert len(backends[1].sessions) == 2 and router.backends[1].sessions == 2
    assert router.owner[router.create_session().session_id] == 1


def test_ties_broken_by_load(tok, stack):
    busy, idle = EchoEngine(tok), EchoEngine(tok)
    busy.load, idle.load = 3, 0  # the engine's requests in flight (TransformersEngine.load)
    router, backends = stack([busy, idle])
    a, b = router.create_session().session_id, router.create_session().session_id
    # equal open sessions -> least load wins; then fewer open sessions beats a lower load
    assert [router.owner[a], router.owner[b]] == [1, 0]
    busy.load = 0  # full tie -> lowest index
    assert router.owner[router.create_session().session_id] == 0
    with pytest.raises(ValueError, match="backends is empty"):
        start_router([])
    with pytest.raises(ValueError, match=r"backends\[1\] is 'http://x'"):
        start_router([backends[0], "http://x"])


def _conversation(info, tok):
    """Four turns alternating wires and streaming; returns the wire's sampled ids per turn."""
    oc = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    ac = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0, timeout=60)
    msgs, out = [], []
    for t in range(4):
        msgs.append({"role": "user", "content": f"Turn {t}: {t} + {t}?"})
        if t == 0:
            r = oc.chat.completions.create(model="m", messages=msgs, max_tokens=8, seed=t)
            ids, text = r.choices[0].token_ids, r.choices[0].message.content or ""
        elif t == 1:
            stream = oc.chat.completions.create(model="m", messages=msgs, max_tokens=8, seed=t, stream=True)
            ids, text = [], ""
            for ch in stream:
                for ce in ch.choices:
                    text += ce.delta.content or ""
                    ids += (ce.model_extra or {}).get("token_ids", [])
        elif t == 2:
            with ac.messages.stream(model="m", max_tokens=8, messages=msgs, extra_body={"seed": t}) as st:
                final = st.get_final_message()
            ids, text = final.model_extra["token_ids"], "".join(b.text for b in final.content if b.type == "text")
        else:
            r = ac.messages.create(model="m", max_tokens=8, messages=msgs, extra_body={"seed": t})
            ids, text = r.token_ids, "".join(b.text for b in r.content if b.type == "text")
        out.append(ids)
        msgs.append({"role": "assistant", "content": text})
    return out


def test_token_exact_through_router_equals_direct(tok, stack):
    model = load_model("builtin:tiny-qwen3")
    engines = [TransformersEngine(model, tok, max_batch_size=4, seed=0),
               TransformersEngine(model, tok, max_batch_size=4, seed=1)]
    try:
        router, backends = stack(engines)
        routed = router.create_session()
        owner = backends[router.owner[routed.session_id]]
        direct = owner.create_session()  # same engine, no router
        ids_routed, ids_direct = _conversation(routed, tok), _conversation(direct, tok)
        assert ids_routed == ids_direct and all(len(x) >= 1 for x in ids_routed)
        tr, td = owner.trajectory(routed.session_id), owner.trajectory(direct.session_id)
        assert sampled(tr) == [t for x in ids_routed for t in x]
        assert [s.token_ids for s in tr.segments] == [s.token_ids for s in td.segments]
        assert [s.loss_mask for s in tr.segments] == [s.loss_mask for s in td.segments]
        # equal to float rounding: the second conversation reuses the first one's keys/values
        # from the engine's prefix cache (same ids), computed in other forwards
        for a, b in zip(tr.segments, td.segments):
            assert [x is None for x in a.logprobs] == [x is None for x in b.logprobs]
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs) if x is not None), default=0.0) <= 1e-5
        assert check_tokens(tr) == TokenCheck(0, 0)  # every action token is what the engine sampled
    finally:
        for e in engines:
            e.close()


def test_unknown_session_and_keys(tok, stack):
    router, _ = stack([EchoEngine(tok), EchoEngine(tok)], pairs=True, admin_key="adm")  # remote-style backends
    assert [b.handle for b in router.backends] == [None, None]
    base = f"{router.base_url}/s/snope"
    with pytest.raises(openai.NotFoundError, match="unknown session 'snope'"):
        openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.NotFoundError, match="unknown session 'snope'"):
        anthropic.Anthropic(base_url=base, api_key="k", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{base}/v1/messages", json={})
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{base}/v1/models")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = httpx.get(f"{router.base_url}/sessions/snope/trajectory", headers={"x-api-key": "adm"})
    assert r.status_code == 404 and "unknown session 'snope'" in r.json()["error"]["message"]
    assert httpx.post(f"{router.base_url}/sessions", headers={"x-api-key": "wrong"}).status_code == 401
    assert httpx.post(f"{router.base_url}/sessions").status_code == 401
    info = router.create_session()
    # the session's own key is checked by its backend, and the 401 comes back in the wire's shape
    r = httpx.post(f"{info.anthropic_base_url}/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{info.openai_base_url}/models", headers={"authorization": f"Bearer {info.api_key}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
    # a body the backend refuses at session creation comes back as its 400
    r = httpx.post(f"{router.base_url}/sessions", headers={"x-api-key": "adm"}, json={"bogus": 1})
    assert r.status_code == 400 and "unknown field(s) ['bogus']" in r.json()["error"]["message"]
    assert sum(b.sessions for b in router.backends) == 1


def test_backend_down_is_a_clean_5xx(tok, stack):
    # one connect retry (tried at once, no backoff): the defaults would wait 1.5 s per request
    router, backends = stack([EchoEngine(tok), EchoEngine(tok)], admin_key="adm", connect_retries=1)
    a, b = router.create_session(), router.create_session()
    assert [router.owner[a.session_id], router.owner[b.session_id]] == [0, 1]
    backends[1].stop()
    with pytest.raises(openai.InternalServerError) as ei:
        openai.OpenAI(base_url=b.openai_base_url, api_key=b.api_key, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 502
    assert f"backend 1 at {backends[1].base_url} (owner of session {b.session_id}) is unreachable" in str(ei.value)
    with pytest.raises(anthropic.InternalServerError) as ei:
        anthropic.Anthropic(base_url=b.anthropic_base_url, api_key=b.api_key, max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 502 and ei.value.body["error"]["type"] == "api_error"
    r = httpx.get(f"{router.base_url}/sessions/{b.session_id}/trajectory", headers={"x-api-key": "adm"})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    # the live backend keeps serving; a new session skips the dead one (preferred: fewer sessions)
    r = openai.OpenAI(base_url=a.openai_base_url, api_key=a.api_key, max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content.startswith("len ")
    httpx.delete(f"{router.base_url}/sessions/{a.session_id}", headers={"x-api-key": "adm"})
    c = router.create_session()
    assert router.owner[c.session_id] == 0 and router.backends[1].sessions == 1
    backends[0].stop()
    r = httpx.post(f"{router.base_url}/sessions", headers={"x-api-key": "adm"})
    assert r.status_code == 503 and r.json()["error"]["message"].startswith("no backend could open a session: backend ")
    assert router.running


def test_molt_serve_num_engines(monkeypatch):
    """``molt serve --num-engines 2`` in-process (CliRunner in a thread): two engines, each
    behind its own server, one router URL printed; stopping the router ends the command."""
    from click.testing import CliRunner

    import molt_core.cli.router as rt
    from molt_core.cli import main

    made, result, real = [], {}, rt.start_router
    monkeypatch.setattr(rt, "start_router", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    args = ["serve", "--model", "builtin:tiny-qwen3", "--num-engines", "2", "--max-batch-size", "2"]
    th = threading.Thread(target=lambda: result.update(r=CliRunner().invoke(main, args, env={"MOLT_ADMIN_KEY": "adm-test"})))
    th.start()
    deadline = time.monotonic() + 60
    while not (made and made[0].owner) and th.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert made and made[0].owner, result
    router = made[0]
    try:
        (sid,) = router.owner
        assert router.owner[sid] == 0 and router.admin_key == "adm-test"
        key = router.backends[0].handle.sessions.info(sid).api_key
        r = openai.OpenAI(base_url=f"{router.base_url}/s/{sid}/v1", api_key=key, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=0)
        t = httpx.get(f"{router.base_url}/sessions/{sid}/trajectory", headers={"x-api-key": "adm-test"}).json()
        assert [x for x, m in zip(t["segments"][0]["token_ids"], t["segments"][0]["loss_mask"]) if m] == r.choices[0].token_ids
        assert router.owner[router.create_session().session_id] == 1  # the next session goes to engine 1
    finally:
        router.stop()
        th.join(30)
    out = result["r"]
    assert out.exit_code == 0, out.output
    ready = json.loads(out.output.splitlines()[0])
    assert ready["base_url"] == router.base_url and ready["admin_key"] == "adm-test"
    assert ready["engines"] == [b.base_url for b in router.backends] and len(ready["engines"]) == 2
    assert ready["session"]["openai_base_url"] == f"{router.base_url}/s/{sid}/v1"
    assert all(not b.handle.running for b in router.backends)  # the command stopped its servers


def test_router_body_limit_while_reading(tok, stack):
    """Issue 12 item 2 through the router: its own body limit, enforced while reading, answered
    in the wire's shape (the backend never sees the body)."""
    from molt_core.cli.router import Backend, create_router_app

    router, backends = stack([EchoEngine(tok)], admin_key="adm")
    info = router.create_session()
    from fastapi.testclient import TestClient

    app = create_router_app([Backend(backends[0].base_url, backends[0].admin_key)], "adm", max_body_bytes=100)
    app.state.owner[info.session_id] = 0
    with TestClient(app) as tc:
        r = tc.post(f"/s/{info.session_id}/v1/messages", content=b"x" * 101, headers={"x-api-key": info.api_key})
        assert r.status_code == 413 and r.json() == {"type": "error", "error": {
            "type": "request_too_large", "message": "request body is 101 bytes; the limit is 100",
            "details": {"error_code": "request_too_large"}}}
    assert backends[0].trajectory(info.session_id).segments == [] and backends[0].app.state.engine.calls == 0
