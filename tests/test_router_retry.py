"""The router's retries, by fault injection on a fake upstream that counts every request it read:
a connect the backend refuses is tried again on the same backend (session affinity kept) and
the turn succeeds with the backend seeing it once; a request the backend read and then dropped
(closed, reset, or left unanswered past the timeout) is answered with a 502 in the wire's shape
and never replayed; no more than ``max_connections`` connections are open at once, a new one
per request unless ``keepalive_connections`` keeps some; bad options are refused by name."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from typing import Any

import httpx
import pytest

from molt_core.cli.router import start_router


class FakeUpstream:
    """A molt-shaped HTTP/1.1 server on its own event loop thread. ``POST /sessions`` opens
    session ``s<n>``; any other request is counted in ``requests`` (path, body) and then handled
    as ``mode`` says: ``"ok"`` (200 JSON, keep-alive, after ``delay`` s), ``"once"`` (200 JSON,
    then the idle connection is closed, as a keep-alive timeout does), ``"close"`` (close the
    connection without answering), ``"reset"`` (close with an RST) or ``"hang"`` (never answer).
    ``listening=False`` binds the port without listening, so every connect is refused until
    :meth:`listen`; ``port`` reuses a port (an engine restarted on it). ``connections`` counts
    accepted connections, ``peak`` the most open at once."""

    def __init__(self, mode: str = "ok", listening: bool = True, delay: float = 0.0, port: int = 0) -> None:
        self.mode, self.delay = mode, delay
        self.requests: list[tuple[str, Any]] = []
        self.writers: set[asyncio.StreamWriter] = set()
        self.sessions = self.connections = self.open = self.peak = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server: asyncio.AbstractServer | None = None
        if listening:
            self.listen()

    def listen(self) -> None:
        """Start accepting on the bound port (from now on connects succeed)."""
        async def start() -> None:
            self.server = await asyncio.start_server(self.handle, sock=self.sock)
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(5)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.add(writer)
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(fields.get("content-length", 0)))
                if method == "POST" and path == "/sessions":
                    self.sessions += 1
                    out = {"session_id": f"s{self.base_url[-5:]}-{self.sessions}", "api_key": "k"}
                else:
                    self.requests.append((path, json.loads(body) if body else None))
                    if self.mode == "close":
                        return
                    if self.mode == "reset":  # SO_LINGER 0: close() sends an RST
                        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                   struct.pack("ii", 1, 0))
                        return
                    if self.mode == "hang":
                        await asyncio.sleep(3600)
                    await asyncio.sleep(self.delay)
                    out = {"id": "x", "choices": [{"message": {"role": "assistant", "content": "hi"}}]}
                data = json.dumps(out).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
                await writer.drain()
                if self.mode == "once" and self.requests:
                    return
        except asyncio.CancelledError:  # close() ends every handler
            pass
        finally:
            self.open -= 1
            self.writers.discard(writer)
            writer.close()

    def close(self) -> None:
        """Stop serving (listening socket and open connections closed) and the loop thread (idempotent)."""
        if not self.thread.is_alive():
            return

        async def stop() -> None:
            if self.server is not None:
                self.server.close()
            for w in list(self.writers):
                w.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
            await asyncio.sleep(0.05)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.sock.close()


@pytest.fixture()
def make():
    """``make(upstreams, **router_kw)`` -> a router over them; everything stopped afterwards."""
    made: list[Any] = []

    def build(ups, **kw):
        made.extend(ups)
        router = start_router([(u.base_url, "adm-k") for u in ups], admin_key="adm", **kw)
        made.append(router)
        return router

    yield build
    for x in reversed(made):
        (x.stop if hasattr(x, "stop") else x.close)()


def open_session(router) -> str:
    r = httpx.post(f"{router.base_url}/sessions", headers={"x-api-key": "adm"}, json={}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def chat(router, sid: str, n: int, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{router.base_url}/s/{sid}/v1/chat/completions", timeout=timeout,
                      json={"model": "m", "messages": [{"role": "user", "content": f"turn {n}"}]})


def test_refused_connects_retried_on_the_same_backend(make):
    """Backend 1 restarts: its port refuses connects until the router has tried three times;
    the turn then succeeds on backend 1 (not moved to backend 0), which read it exactly once."""
    a, b = FakeUpstream(), FakeUpstream()
    router = make([a, b], connect_retries=5)
    sa, sb = open_session(router), open_session(router)
    assert (router.owner[sa], router.owner[sb]) == (0, 1)
    assert chat(router, sa, 0).status_code == 200 and chat(router, sb, 0).status_code == 200
    b.close()  # the engine goes away: its pooled connection is closed, its port refuses
    b2 = FakeUpstream(listening=False, port=int(b.base_url.rsplit(":", 1)[1]))
    flip = threading.Thread(target=_listen_after, args=(router.backends[1], 3, b2), daemon=True)
    flip.start()
    t0 = time.monotonic()
    r = chat(router, sb, 1)
    took = time.monotonic() - t0
    flip.join(5)
    try:
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi"
        assert router.backends[1].connect_retries == 3 and router.backends[0].connect_retries == 0
        assert b2.requests == [(f"/s/{sb}/v1/chat/completions",
                                {"model": "m", "messages": [{"role": "user", "content": "turn 1"}]})]
        assert len(a.requests) == 1 and router.owner[sb] == 1  # affinity kept: backend 0 saw only its own turn
        assert 1.0 <= took < 10  # the backoff: 0, 0.5, 1 s before the 2nd, 3rd, 4th connect
    finally:
        b2.close()


def _listen_after(backend, retries: int, up: FakeUpstream) -> None:
    """Start ``up`` listening once the router has retried ``retries`` connects to ``backend``
    (its next connect comes after a backoff of at least 0.5 s)."""
    t0 = time.monotonic()
    while backend.connect_retries < retries and time.monotonic() - t0 < 20:
        time.sleep(0.002)
    up.listen()


def test_pooled_connection_closed_by_the_backend_is_not_used(make):
    """The backend closes each connection after answering (its keep-alive ended): the pool
    drops it before use, so the next turn opens a new one and nothing fails or is sent twice."""
    up = FakeUpstream("once")
    router = make([up], connect_retries=0, keepalive_connections=4)
    sid = open_session(router)
    for n in range(3):
        assert chat(router, sid, n).status_code == 200
        time.sleep(0.05)  # the backend's FIN arrives
    assert [b["messages"][0]["content"] for _, b in up.requests] == ["turn 0", "turn 1", "turn 2"]
    assert up.connections == 3 and router.backends[0].connect_retries == 0  # turn 0 on the session's connection


ANTHROPIC = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("mode,cause", [("close", "RemoteProtocolError: Server disconnected without sending a response."),
                                        ("reset", "ReadError: no response")])
def test_request_read_then_dropped_is_never_replayed(make, mode, cause):
    """The backend read the turn and dropped the connection: one attempt, a 502 in each wire's
    shape saying it may have been received, no replay (a replaying router fails the count)."""
    up = FakeUpstream(mode)
    router = make([up], connect_retries=3)
    sid = open_session(router)
    r = chat(router, sid, 0)
    fate = "the request may have been received and was not replayed; the session commits only answered turns"
    assert r.status_code == 502 and r.json() == {"error": {
        "message": f"backend 0 at {up.base_url} (owner of session {sid}) is unreachable: {cause}; {fate}",
        "type": "server_error", "param": None, "code": "backend_unreachable"}}
    r = httpx.post(f"{router.base_url}/s/{sid}/v1/messages", json=ANTHROPIC, timeout=30)
    assert r.status_code == 502 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert r.json()["error"]["message"].endswith(f"{cause}; {fate}")
    assert [p for p, _ in up.requests] == [f"/s/{sid}/v1/chat/completions", f"/s/{sid}/v1/messages"]
    assert router.backends[0].connect_retries == 0


def test_read_timeout_is_never_replayed(make):
    """A backend that read the turn and does not answer within ``timeout``: one attempt, a 502."""
    up = FakeUpstream("hang")
    router = make([up], timeout=0.5, connect_retries=3)
    sid = open_session(router)
    r = chat(router, sid, 0)
    assert r.status_code == 502 and r.json()["error"]["code"] == "backend_unreachable"
    assert "is unreachable: ReadTimeout" in r.json()["error"]["message"]
    assert "may have been received and was not replayed" in r.json()["error"]["message"]
    assert len(up.requests) == 1 and router.backends[0].connect_retries == 0


def test_fake_upstream_counts_a_replay():
    """The fault check itself: a client that replays a dropped request is seen twice, so the
    counts above would catch a router that replays."""
    up = FakeUpstream("close")
    try:
        with httpx.Client(timeout=10) as c:
            for _ in range(2):  # what a replaying router would do
                with pytest.raises(httpx.RemoteProtocolError):
                    c.post(f"{up.base_url}/s/x/v1/chat/completions", json={"n": 1})
        assert up.requests == [("/s/x/v1/chat/completions", {"n": 1})] * 2
    finally:
        up.close()


def test_refused_until_the_retries_run_out(make):
    """A backend whose port keeps refusing: ``connect_retries`` + 1 connects (no backoff before
    the first retry), then a 502 in the wire's shape saying the request was not received."""
    up = FakeUpstream()
    router = make([up], connect_retries=1)
    sid = open_session(router)
    up.close()
    gone = FakeUpstream(listening=False, port=int(up.base_url.rsplit(":", 1)[1]))
    try:
        r = httpx.post(f"{router.base_url}/s/{sid}/v1/messages", json=ANTHROPIC, timeout=30)
        assert r.status_code == 502 and r.json() == {"type": "error", "error": {"type": "api_error", "message": (
            f"backend 0 at {up.base_url} (owner of session {sid}) is unreachable: ConnectError: All connection "
            f"attempts failed; the request was not received (connection tried 2 times)"),
            "details": {"error_code": "backend_unreachable"}}}
        assert router.backends[0].connect_retries == 1 and gone.requests == []
    finally:
        gone.close()


@pytest.mark.parametrize("keep,opened", [(0, 13), (2, 2)])
def test_pool_bounded(make, keep, opened):
    """``max_connections=2``: six concurrent turns, never more than two connections open at once;
    by default each request opens its own (13: the session's POST and 12 turns); with
    ``keepalive_connections=2`` a second burst reuses the first's two (kept alive)."""
    up = FakeUpstream(delay=0.2)
    router = make([up], max_connections=2, keepalive_connections=keep)
    sid = open_session(router)

    async def burst(k: int) -> list[int]:
        async with httpx.AsyncClient(timeout=30) as c:
            rs = await asyncio.gather(*[c.post(f"{router.base_url}/s/{sid}/v1/chat/completions", json={"n": k + j})
                                        for j in range(6)])
        return [r.status_code for r in rs]

    assert asyncio.run(burst(0)) == [200] * 6
    assert asyncio.run(burst(6)) == [200] * 6
    assert (up.connections, up.peak, len(up.requests)) == (opened, 2, 12)
    assert sorted(b["n"] for _, b in up.requests) == list(range(12))


@pytest.mark.parametrize("kw,msg", [
    ({"connect_retries": -1}, "connect_retries is -1: give an integer from 0 to 10 (default 3)"),
    ({"connect_retries": 11}, "connect_retries is 11: give an integer from 0 to 10 (default 3)"),
    ({"connect_timeout": 0}, "connect_timeout is 0: give seconds > 0 (default 5.0)"),
    ({"max_connections": 0}, "max_connections is 0: give an integer >= 1, at least the sessions in flight (default 1024)"),
    ({"max_connections": 8, "keepalive_connections": 9}, "keepalive_connections is 9: give an integer from 0 to "
     "max_connections (8); 0 (default): a new connection per request"),
])
def test_bad_options_refused_by_name(kw, msg):
    with pytest.raises(ValueError) as ei:
        start_router([("http://127.0.0.1:9", "k")], **kw)
    assert str(ei.value) == msg
