"""Request router in front of several loopback servers: one base URL, the same admin and
session API as one server (:mod:`molt_core.server.app`), session affinity, load balancing.

* ``POST /sessions`` (router admin key) opens the session on the backend with the fewest open
  sessions, then the least load (its engine's ``load`` -- requests in flight -- for a local
  :class:`~molt_core.server.app.ServerHandle`, else the requests the router has in flight to
  it), ties to the lowest index; an unreachable backend is skipped. The returned URLs point at
  the router.
* ``/s/{sid}/...`` (any method, both wires, SSE streamed through chunk by chunk) goes to the
  backend that owns ``sid``; the session's own key is checked by that backend.
* ``GET /sessions/{sid}/trajectory`` and ``DELETE /sessions/{sid}`` are forwarded with the
  backend's admin key.

Unknown session or route, wrong method: 404/405 in the wire's error shape (Anthropic for
``.../v1/messages``, OpenAI otherwise). A client that disconnects closes the forwarded request,
so the backend aborts the generation and commits nothing. A backend that cannot be reached: 502 naming the backend and the cause (503 when
no backend can open a session) -- never a 500.

Retries: a request the backend never received -- its connection could not be opened (refused,
reset during the handshake, ``connect_timeout`` passed) -- is retried on the same backend (the
session's owner: affinity is kept) up to ``connect_retries`` times by httpx's own transport
(``httpx.AsyncHTTPTransport(retries=...)``: connect errors and connect timeouts only, after 0,
0.5, 1, 2, ... s). A pooled keep-alive connection the backend closed is dropped by the pool
before use. A request that may have reached the backend (an error or a timeout while reading
its answer) is never replayed: it gets a 502 in the wire's shape, and the backend's ledger,
which commits a turn only once it is answered, stays the judge. Each :class:`Backend` counts
its connect retries (``connect_retries``). Up to ``max_connections`` connections (all backends
together) are open at once; more requests in flight wait for a free one. By default each request
opens its own connection (a loopback connect): httpcore 1.0.9's pool can close an idle
connection it has already handed to a request (encode/httpcore#1110), which kills that request
half sent, and a backend can close one as it is reused. ``keepalive_connections`` > 0 keeps
that many idle for reuse (5 s), for backends where a connect costs more than that risk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from molt_core.plugins import wires as registered_wires
from molt_core.server.app import ServerHandle, _key_of, serve_in_thread
from molt_core.server.guard import (
    DEFAULT_MAX_BODY_BYTES,
    ClientDisconnected,
    error_body,
    install_http_error_handlers,
    read_body,
    until_disconnect,
    wire_error_response,
)
from molt_core.server.wires import WireError

__all__ = ["Backend", "RouterHandle", "create_router_app", "start_router"]

log = logging.getLogger(__name__)
_HOP = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "date", "server"}


@dataclass
class Backend:
    """One loopback server behind the router: ``base_url``, its ``admin_key``, the local
    ``handle`` (None for a remote one), ``sessions`` open through the router and the router's
    ``in_flight`` requests to it (sent, response head not yet back) and its ``connect_retries``
    (connections that failed to open and were tried again)."""

    base_url: str
    admin_key: str
    handle: ServerHandle | None = None
    sessions: int = 0
    in_flight: int = 0
    connect_retries: int = 0

    @property
    def load(self) -> int:
        """Requests in flight: the local engine's ``load`` when it has one, else ``in_flight``."""
        n = getattr(self.handle.app.state.engine, "load", None) if self.handle is not None else None
        return n if isinstance(n, int) else self.in_flight


def _error(wire: Any, status: int, message: str, code: str | None = None) -> JSONResponse:
    body = error_body(wire, status, message, code=code)
    if status >= 500:  # the wire's server-error type (OpenAI's by default)
        body["error"]["type"] = getattr(wire, "server_error_type", "server_error")
    return JSONResponse(body, status_code=status)


def _check_client_options(connect_timeout: float, connect_retries: int, max_connections: int,
                          keepalive_connections: int) -> None:
    if not (isinstance(connect_timeout, (int, float)) and connect_timeout > 0):
        raise ValueError(f"connect_timeout is {connect_timeout!r}: give seconds > 0 (default 5.0)")
    if not (isinstance(connect_retries, int) and 0 <= connect_retries <= 10):
        raise ValueError(f"connect_retries is {connect_retries!r}: give an integer from 0 to 10 (default 3)")
    if not (isinstance(max_connections, int) and max_connections >= 1):
        raise ValueError(f"max_connections is {max_connections!r}: give an integer >= 1, at least the sessions "
                         f"in flight (default 1024)")
    if not (isinstance(keepalive_connections, int) and 0 <= keepalive_connections <= max_connections):
        raise ValueError(f"keepalive_connections is {keepalive_connections!r}: give an integer from 0 to "
                         f"max_connections ({max_connections}); 0 (default): a new connection per request")


def create_router_app(backends: list[Backend], admin_key: str | None = None, timeout: float | None = None,
                      max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, connect_timeout: float = 5.0,
                      connect_retries: int = 3, max_connections: int = 1024,
                      keepalive_connections: int = 0) -> FastAPI:
    """The router's ASGI app over ``backends`` (see the module docstring for the routes).

    Args:
        backends: at least one :class:`Backend`.
        admin_key: key for the router's ``/sessions`` routes (random when None; read
            ``app.state.admin_key``).
        timeout: seconds to wait for a backend's response (None: no limit).
        max_body_bytes: request body limit on session routes, enforced while reading (413).
        connect_timeout: seconds to open one connection to a backend.
        connect_retries: tries again after a failed connect, on the same backend (0: none); the
            longest wait before a 502 is ``(connect_retries + 1) * connect_timeout`` plus the
            backoff (1.5 s for 3 retries).
        max_connections: connections open to the backends at once (all together): size it for
            the sessions in flight; more requests wait for one.
        keepalive_connections: idle connections kept for reuse, up to 5 s (0: a new connection
            per request; see the module docstring).

    Returns:
        A FastAPI app; ``app.state.owner`` maps session id -> backend index.

    Raises:
        ValueError: ``backends`` is empty, or an option is out of range (the message names it).
    """
    if not backends:
        raise ValueError("backends is empty: give at least one ServerHandle or (base_url, admin_key)")
    _check_client_options(connect_timeout, connect_retries, max_connections, keepalive_connections)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        # with no idle connection kept, the pool never hands one out, so it cannot close one
        # under a request (encode/httpcore#1110); 5 s is well before a molt server's 30 s keep-alive
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=keepalive_connections,
                              keepalive_expiry=5.0)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=connect_timeout),
                                            transport=httpx.AsyncHTTPTransport(retries=connect_retries, limits=limits))
        yield
        await state["client"].aclose()

    app = FastAPI(title="molt request router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.admin_key = admin_key or "molt-admin-" + secrets.token_hex(16)
    app.state.backends = backends
    owner: dict[str, int] = {}
    app.state.owner = owner
    app.state.base_url = ""  # set by start_router; else the URL the client used
    app.state.wires = wires = registered_wires()  # their error shapes (the Anthropic wire's on .../v1/messages)
    install_http_error_handlers(app)

    def admin_ok(request: Request) -> bool:
        key = _key_of(request)
        return key is not None and secrets.compare_digest(key.encode(), app.state.admin_key.encode())

    def unauthorized() -> JSONResponse:
        return _error("openai", 401, "missing or wrong admin key: send the router's admin key as "
                                     "'Authorization: Bearer <key>' or 'x-api-key: <key>'", "invalid_api_key")

    def fate(e: Exception) -> str:
        if isinstance(e, httpx.PoolTimeout):
            return f"the request was not sent: all {max_connections} pooled connections stayed busy (max_connections)"
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            return f"the request was not received (connection tried {connect_retries + 1} times)"
        # it may have been received: a replay could run the turn twice
        return "the request may have been received and was not replayed; the session commits only answered turns"

    def down(wire: Any, i: int, e: Exception, what: str) -> JSONResponse:
        return _error(wire, 502, f"backend {i} at {backends[i].base_url} ({what}) is unreachable: "
                                 f"{type(e).__name__}: {str(e) or 'no response'}; {fate(e)}", "backend_unreachable")

    async def forward(i: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> httpx.Response:
        b, opened = backends[i], []

        async def trace(event: str, _: Any) -> None:  # httpcore's hook (async client: a coroutine)
            if event == "connection.retry.started":  # a failed connect tried again
                b.connect_retries += 1
            elif event == "connection.connect_tcp.started":  # not a pooled connection
                opened.append(event)

        b.in_flight += 1  # until the response head arrives: a molt server answers once generated
        try:
            req = state["client"].build_request(method, b.base_url + path, headers=headers, content=body,
                                                extensions={"trace": trace})
            return await state["client"].send(req, stream=True)
        except httpx.TransportError as e:
            log.warning("backend %d at %s, %s %s on a %s connection: %r; %s", i, b.base_url, method, path,
                        "new" if opened else "pooled", e, fate(e))
            raise
        finally:
            b.in_flight -= 1

    def relay(i: int, resp: httpx.Response) -> StreamingResponse:
        async def chunks() -> Any:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.TransportError as e:  # the backend died mid-stream: end the stream
                log.warning("backend %d at %s broke off a response: %r", i, backends[i].base_url, e)
            finally:
                await resp.aclose()

        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        # the background close also runs when the client left before the body was iterated
        return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers,
                                 background=BackgroundTask(resp.aclose))

    @app.post("/sessions")
    async def create_session(request: Request) -> Any:
        if not admin_ok(request):
            return unauthorized()
        body = await request.body()
        order = sorted(range(len(backends)), key=lambda j: (backends[j].sessions, backends[j].load, j))
        errors = []
        for i in order:
            backends[i].sessions += 1  # reserve before awaiting, so concurrent creates spread out
            try:
                resp = await forward(i, "POST", "/sessions", {"x-api-key": backends[i].admin_key,
                                                               "content-type": "application/json"}, body)
            except httpx.TransportError as e:
                backends[i].sessions -= 1
                errors.append(f"backend {i} at {backends[i].base_url}: {type(e).__name__}: {e}")
                continue
            try:
                raw = await resp.aread()
            except httpx.TransportError as e:
                backends[i].sessions -= 1
                errors.append(f"backend {i} at {backends[i].base_url}: {type(e).__name__}: {e}")
                continue
            finally:
                await resp.aclose()
            if resp.status_code != 200:  # the backend refused the body: pass its error through
                backends[i].sessions -= 1
                return Response(raw, status_code=resp.status_code, media_type="application/json")
            try:
                info = json.loads(raw)
                sid = info["session_id"]
            except (ValueError, KeyError, TypeError):  # not a molt server: try the next one
                backends[i].sessions -= 1
                errors.append(f"backend {i} at {backends[i].base_url}: answered without a session_id: {raw[:200]!r}")
                continue
            owner[sid] = i
            base = app.state.base_url or str(request.base_url).rstrip("/")
            return {**info, "openai_base_url": f"{base}/s/{sid}/v1", "anthropic_base_url": f"{base}/s/{sid}"}
        return _error("openai", 503, "no backend could open a session: " + "; ".join(errors), "backend_unreachable")

    @app.api_route("/sessions/{sid}/trajectory", methods=["GET"])
    @app.api_route("/sessions/{sid}", methods=["DELETE"])
    async def admin_forward(sid: str, request: Request) -> Any:
        if not admin_ok(request):
            return unauthorized()
        i = owner.get(sid)
        if i is None:
            return _error("openai", 404, f"unknown session {sid!r}; create one with POST /sessions", "session_not_found")
        try:
            resp = await forward(i, request.method, request.url.path, {"x-api-key": backends[i].admin_key})
        except httpx.TransportError as e:
            return down("openai", i, e, f"owner of session {sid}")
        if request.method == "DELETE" and resp.status_code in (200, 404) and owner.pop(sid, None) is not None:
            backends[i].sessions -= 1
        return relay(i, resp)

    @app.api_route("/s/{sid}/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def session_route(sid: str, rest: str, request: Request) -> Any:
        wire = wires.get("anthropic", "openai") if rest.rstrip("/").endswith("v1/messages") else "openai"
        i = owner.get(sid)
        if i is None:
            return _error(wire, 404, f"unknown session {sid!r}; create one with POST /sessions", "session_not_found")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            body = await read_body(request, max_body_bytes)
        except WireError as e:
            return wire_error_response(wire, e)
        try:  # a client that leaves closes the backend request too, so the backend aborts the turn
            resp = await until_disconnect(request, forward(i, request.method, path, headers, body))
        except ClientDisconnected:
            return Response(status_code=499)
        except httpx.TransportError as e:
            return down(wire, i, e, f"owner of session {sid}")
        return relay(i, resp)

    return app


class RouterHandle:
    """A running router (see :func:`start_router`). Attributes: ``base_url``, ``admin_key``,
    ``app``, ``backends`` (list of :class:`Backend`), ``owner`` (session id -> backend index)."""

    def __init__(self, app: FastAPI, server: Any, thread: threading.Thread, base_url: str) -> None:
        self.app, self._server, self._thread, self.base_url = app, server, thread, base_url
        self.admin_key: str = app.state.admin_key
        self.backends: list[Backend] = app.state.backends
        self.owner: dict[str, int] = app.state.owner

    def create_session(self, **body: Any) -> Any:
        """Open a session through the router (HTTP); returns a
        :class:`~molt_core.server.app.SessionInfo`. Raises: httpx.HTTPStatusError on a 4xx/5xx."""
        from molt_core.server.app import SessionInfo

        r = httpx.post(f"{self.base_url}/sessions", json=body, headers={"x-api-key": self.admin_key}, timeout=30)
        r.raise_for_status()
        return SessionInfo.model_validate(r.json())

    @property
    def running(self) -> bool:
        """True while the router thread is serving."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the router (not its backends) and join its thread (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> RouterHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_router(backends: list[ServerHandle | tuple[str, str]], admin_key: str | None = None, port: int = 0,
                 host: str = "127.0.0.1", timeout: float | None = None, connect_timeout: float = 5.0,
                 connect_retries: int = 3, max_connections: int = 1024,
                 keepalive_connections: int = 0) -> RouterHandle:
    """Serve a router over ``backends`` (running :class:`ServerHandle` s, or
    ``(base_url, admin_key)`` pairs of servers elsewhere) on ``host:port`` (0: a free random
    port) in a daemon thread; returns once it accepts connections. ``timeout``,
    ``connect_timeout``, ``connect_retries``, ``max_connections`` and ``keepalive_connections``:
    see :func:`create_router_app`.

    Raises:
        ValueError: ``backends`` is empty or holds something else, or an option is out of range.
        OSError: the port cannot be bound.
        RuntimeError: the router did not start within 30 s.
    """
    bs = []
    for j, b in enumerate(backends):
        if isinstance(b, ServerHandle):
            bs.append(Backend(b.base_url, b.admin_key, b))
        elif isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, str) for x in b):
            bs.append(Backend(b[0].rstrip("/"), b[1]))
        else:
            raise ValueError(f"backends[{j}] is {b!r}: give a ServerHandle or a (base_url, admin_key) pair")
    app = create_router_app(bs, admin_key, timeout, connect_timeout=connect_timeout,
                            connect_retries=connect_retries, max_connections=max_connections,
                            keepalive_connections=keepalive_connections)
    server, thread, base_url = serve_in_thread(app, host, port, "molt-router", lifespan="on",
                                               on_bind=lambda url: setattr(app.state, "base_url", url))
    return RouterHandle(app, server, thread, base_url)
