"""The loopback server: the wires into one :class:`~molt_core.ledger.Ledger` per session, session
admin, and a background-thread runner on 127.0.0.1 with a random port.

Routes: ``POST /s/{sid}/v1/chat/completions`` (the kernel's OpenAI wire), every registered wire's routes
(``molt_register_wires``), ``GET /s/{sid}/v1/models``; admin: ``POST /sessions``,
``GET /sessions/{sid}/trajectory``, ``DELETE /sessions/{sid}``. Notes: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from molt_core.config import ImagePolicy
from molt_core.ledger import AssistantTurn, Ledger, Prepared, PromptTooLong, take_turn
from molt_core.plugins import modality as registered_modality
from molt_core.plugins import tool_parser as registered_tool_parser
from molt_core.plugins import window_prover as registered_window_prover
from molt_core.plugins import wires as registered_wires
from molt_core.server.guard import (
    DEFAULT_MAX_BODY_BYTES,
    ClientDisconnected,
    install_http_error_handlers,
    parse_json,
    read_body,
    read_json,
    until_disconnect,
    wire_error_response,
)
from molt_core.server.images import ImagePartRefused, request_images
from molt_core.server.tool_results import match_tool_results
from molt_core.server.wires import (ChatCompletionRequest, WireError, one_call_stop, openai_response, openai_stream,
                                    validation_message)
from molt_core.types import GenerationOutput, SamplingParams, Trajectory

__all__ = ["SessionInfo", "SessionStore", "WireServer", "create_app", "start_server", "ServerHandle"]

MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
#: bodies up to this many bytes are rendered and tokenized on the event loop, bigger ones in a thread
INLINE_PREPARE_BYTES = 16 * 1024
log = logging.getLogger(__name__)


class SessionInfo(BaseModel):
    """What a client needs to talk to one session (both wires share its ledger)."""

    session_id: str
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    rollout_id: str


@dataclass
class _Session:
    id: str
    api_key: str
    ledger: Ledger
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    seed: int | None = None  # seeds turn t of a request without its own seed with seed + t (a seeded eval episode)
    turns: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # wire plugins' per-session state, freed with the session

    @property
    def responses(self) -> Any:
        """The Responses wire's stored responses of this session (its ``state["responses"]``; empty: ``()``)."""
        return self.state.get("responses", ())


class SessionStore:
    """Sessions of one server: the Python API the runtime uses without HTTP.

    Args:
        tokenizer: the served model's tokenizer (with a chat template).
        base_url: the server's ``http://127.0.0.1:PORT`` (set once it listens).
        chat_template_kwargs: default template variables for new sessions.
        tool_parser: the model family's tool-call parser object (:func:`molt_core.plugins.tool_parser`; default Hermes).
        vision, image_policy, modality, window_prover: as :func:`create_app`.
    """

    def __init__(self, tokenizer: Any, base_url: str = "", chat_template_kwargs: dict[str, Any] | None = None,
                 tool_parser: Any = None, vision: Any = None, image_policy: ImagePolicy | None = None,
                 modality: Any = None, window_prover: Any = None) -> None:
        self.tokenizer = tokenizer
        self.modality, self.window_prover = modality, window_prover
        self.tool_parser = tool_parser
        self.vision, self.image_policy = vision, image_policy or ImagePolicy()
        self.base_url = base_url
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def create(self, rollout_id: str | None = None, group_id: str = "",
               chat_template_kwargs: dict[str, Any] | None = None, seed: int | None = None) -> SessionInfo:
        """Open a session (one rollout): a fresh ledger and API key. With ``seed``, its ``t``-th
        generated turn (0-based) samples with seed ``seed + t`` unless the request names its own.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        sid = "s" + secrets.token_hex(12)
        kwargs = {**self.template_kwargs, **(chat_template_kwargs or {})}
        ledger = Ledger(self.tokenizer, rollout_id=rollout_id, group_id=group_id, chat_template_kwargs=kwargs,
                        tool_parser=self.tool_parser, vision=self.vision, image_policy=self.image_policy,
                        modality=self.modality, window_prover=self.window_prover)
        s = _Session(sid, "sk-molt-" + secrets.token_hex(16), ledger, seed=seed)
        with self._lock:
            self._sessions[sid] = s
        return self.info(sid)

    def info(self, sid: str) -> SessionInfo:
        """URLs and key of session ``sid``. Raises: KeyError for an unknown session."""
        s = self._get(sid)
        return SessionInfo(session_id=sid, openai_base_url=f"{self.base_url}/s/{sid}/v1",
                           anthropic_base_url=f"{self.base_url}/s/{sid}", api_key=s.api_key,
                           rollout_id=s.ledger.rollout_id)

    def _get(self, sid: str) -> _Session:
        with self._lock:
            s = self._sessions.get(sid)
        if s is None:
            raise KeyError(f"unknown session {sid!r}; create one with POST /sessions")
        return s

    def ledger(self, sid: str) -> Ledger:
        """The session's ledger. Raises: KeyError for an unknown session."""
        return self._get(sid).ledger

    def trajectory(self, sid: str, reward: float | None = None, **kwargs: Any) -> Trajectory:
        """The session's :class:`Trajectory` so far (``kwargs`` as :meth:`Ledger.trajectory`). Raises: KeyError."""
        return self._get(sid).ledger.trajectory(reward=reward, **kwargs)

    def close(self, sid: str) -> Trajectory:
        """Remove session ``sid`` and return its final :class:`Trajectory`. Raises: KeyError."""
        traj = self.trajectory(sid)
        with self._lock:
            self._sessions.pop(sid, None)
        return traj

    def __len__(self) -> int:
        return len(self._sessions)


def _key_of(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


@dataclass(frozen=True)
class WireServer:
    """What a wire plugin's ``mount(server)`` receives (``molt_register_wires``): one per app.

    * ``app`` -- the FastAPI app; ``tokenizer``, ``model_name`` -- the served model's.
    * ``route(path, method="POST")`` -- decorator registering ``async fn(sid, request)`` at
      ``path`` (with ``{sid}``); ``fn`` returns a JSON-ready dict or a ``Response``.
    * ``await session_request(request, sid, Model)`` -> ``(session, req, body_bytes)``: the session (key
      checked; ``.ledger``, ``.state`` a per-session dict) and the body validated as ``Model``, ``check()`` run.
    * ``images()`` -> a request's image collector (``openai_part``, ``anthropic_block``,
      ``responses_part``); ``await checked(collector, body_bytes)`` runs its checks.
    * ``params_of(temperature, top_p, top_k, seed, stop, stop_token_ids=())`` -> :class:`~molt_core.types.SamplingParams`
      (``stop_token_ids``: e.g. :func:`~molt_core.server.wires.one_call_stop` for ``parallel_tool_calls: false``).
    * ``await run_turn(session, request, messages, tools, params, max_tokens, allow_tool_calls, body_bytes)``
      -> :class:`~molt_core.ledger.AssistantTurn`: one turn under the session's lock, committed on return.
    * ``await guarded(wire, handle)`` -- ``await handle()``, each error in ``wire``'s ``error_body`` shape.

    Raise :class:`~molt_core.server.wires.WireError` for a client error.
    """

    app: Any
    tokenizer: Any
    model_name: str
    route: Callable[..., Any]
    session_request: Callable[..., Any]
    images: Callable[[], Any]
    checked: Callable[..., Any]
    params_of: Callable[..., SamplingParams]
    run_turn: Callable[..., Any]
    guarded: Callable[..., Any]


def create_app(engine: Any, tokenizer: Any | None = None, admin_key: str | None = None, model_name: str = "policy",
               max_model_len: int | None = None, default_max_tokens: int = 1024,
               chat_template_kwargs: dict[str, Any] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tool_parser: Any = None, image_policy: ImagePolicy | None = None, vision: Any = ...,
               modality: Any = ..., wires: Any = ..., window_prover: Any = ...) -> FastAPI:
    """Build the ASGI app over ``engine`` (a :class:`~molt_core.engines.base.RolloutEngine`).

    Args:
        engine: generates from prompt ids; its ``tokenizer`` is used when ``tokenizer`` is None.
        admin_key: key for ``/sessions`` routes (random when None; read ``app.state.admin_key``).
        model_name: the served model id (requests may name any model).
        max_model_len: context length in tokens (default: the first of ``engine.max_model_len``,
            ``engine.max_positions``, the tokenizer's ``model_max_length`` below 10**7); a prompt
            that fills it gets a 400, and ``max_tokens`` is capped to what is left.
        default_max_tokens: new-token budget when a request gives none (capped by the context).
        chat_template_kwargs: template variables for every session (e.g. ``enable_thinking``).
        max_body_bytes: request body limit, enforced while reading (413 above it).
        tool_parser: tool-call parser name (``molt_register_tool_parsers``) or object (None: Hermes).
        image_policy: image limits and whether remote URLs are fetched (:class:`~molt_core.config.ImagePolicy`;
            default: inline only); a refused image is a 400 naming its field (code ``invalid_image``).
        vision: the model's image processor (default: the engine's ``vision_processor``; None: text only).
        modality: the image modality (default: the registered one; None: every image part gets a 400).
        wires: ``{name: wire}`` mounted next to the chat wire (default: the registered ones).
        window_prover: the session ledgers' window prover (default: the registered one; None: full renders).

    Raises:
        ValueError: a ``tool_parser`` name no plugin registered (the message names the plugin).

    Returns:
        A FastAPI app; ``app.state.sessions`` is its :class:`SessionStore`.
    """
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    if max_model_len is None:
        for cand in (getattr(engine, "max_model_len", None), getattr(engine, "max_positions", None),
                     getattr(tokenizer, "model_max_length", None)):
            if isinstance(cand, int) and 0 < cand < 10**7:
                max_model_len = cand
                break
    app = FastAPI(title="molt loopback server", docs_url=None, redoc_url=None, openapi_url=None)
    if tool_parser is not None:
        tool_parser = registered_tool_parser(tool_parser, tokenizer)
    if vision is ...:
        vision = getattr(engine, "vision_processor", None)
    if modality is ...:
        modality = registered_modality()
    if window_prover is ...:
        window_prover = registered_window_prover()
    policy = image_policy or ImagePolicy()
    image_error = (ImagePartRefused, modality.error) if modality is not None else (ImagePartRefused,)
    store = SessionStore(tokenizer, chat_template_kwargs=chat_template_kwargs, tool_parser=tool_parser, vision=vision,
                         image_policy=policy, modality=modality, window_prover=window_prover)
    app.state.sessions = store
    install_http_error_handlers(app)
    app.state.admin_key = admin_key or "molt-admin-" + secrets.token_hex(16)
    app.state.engine = engine
    app.state.wires = dict(registered_wires() if wires is ... else wires)

    error = wire_error_response

    async def body_of(request: Request, empty: Any = ...) -> Any:
        return await read_json(request, max_body_bytes, empty)

    def session_for(request: Request, sid: str) -> _Session:
        try:
            s = store._get(sid)
        except KeyError as e:
            raise WireError(404, e.args[0], code="session_not_found") from None
        key = _key_of(request)
        if key is None or not secrets.compare_digest(key.encode(), s.api_key.encode()):
            raise WireError(401, f"missing or wrong API key for session {sid}: send the session's api_key as "
                                 "'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key")
        return s

    def check_admin(request: Request) -> None:
        key = _key_of(request)
        if key is None or not secrets.compare_digest(key.encode(), app.state.admin_key.encode()):
            raise WireError(401, "missing or wrong admin key: send it as 'Authorization: Bearer <key>' or "
                                 "'x-api-key: <key>'", code="invalid_api_key")

    async def run_turn(s: _Session, request: Request, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, params: SamplingParams, max_tokens: int | None,
                       allow_tool_calls: bool = True, body_bytes: int = 0) -> AssistantTurn:
        fresh = any(v.strip() in ("no-cache", "no-store")
                    for v in request.headers.get("cache-control", "").lower().split(","))

        async def prepare(plan: Callable[[], Prepared]) -> Prepared:
            try:  # a big request off the event loop, so it stalls no other session
                return await asyncio.to_thread(plan) if body_bytes > INLINE_PREPARE_BYTES else plan()
            except PromptTooLong as e:
                raise WireError(400, str(e), "messages", "context_length_exceeded") from None
            except image_error as e:
                raise WireError(400, str(e), e.field, "invalid_image") from None
            except ValueError as e:
                raise WireError(400, str(e), "messages") from None

        async def seeded(run: SamplingParams) -> SamplingParams:
            if s.seed is not None and run.seed is None:  # a seeded session: turn t samples with seed + t
                run = run.model_copy(update={"seed": (s.seed + s.turns) % (1 << 63)})
            s.turns += 1
            return run

        async def generate(start: Callable[[], Any]) -> GenerationOutput:
            try:  # a client that leaves cancels the generation; nothing is committed
                out = await until_disconnect(request, start())
            except ClientDisconnected:
                raise
            except Exception as e:  # the engine failed: nothing is recorded
                raise WireError(503, f"the engine failed: {type(e).__name__}: {e}") from None
            if out.finish_reason == "abort":  # a cut no wire's stop reason names: a failure, nothing is recorded
                raise WireError(503, f"the engine aborted the generation after {len(out.token_ids)} tokens; nothing "
                                     "was recorded: retry the request")
            return out

        async with s.lock:  # the retry key holds the request's own max_tokens (1 when it gave none)
            turn = await take_turn(s.ledger, engine, messages, params.model_copy(update={"max_tokens": max_tokens or 1}),
                                   tools=tools, max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                   max_model_len=max_model_len, fresh=fresh, allow_tool_calls=allow_tool_calls,
                                   prepare_with=prepare, before_engine=seeded, call=generate)
        assert turn is not None  # None only under max_total_tokens
        return turn

    def params_of(temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
                  stop: list[str], stop_token_ids: Any = ()) -> SamplingParams:
        return SamplingParams(temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p,
                              top_k=-1 if top_k is None else top_k, stop=stop, seed=seed, stop_token_ids=list(stop_token_ids))

    async def checked(pending: Any, body_bytes: int) -> None:
        if not pending:  # decoded (and, if allowed, fetched) off the event loop unless small
            return
        if pending.remote or body_bytes > INLINE_PREPARE_BYTES:
            await asyncio.to_thread(pending.check)
        else:
            pending.check()

    async def guarded(wire: Any, fn: Callable[[], Any]) -> Any:
        try:
            return await fn()
        except WireError as e:
            return error(wire, e)
        except image_error as e:  # a refused image, named by its wire field
            return error(wire, WireError(400, str(e), e.field, "invalid_image"))
        except ClientDisconnected:  # nobody reads this answer (499: client closed request)
            return Response(status_code=499)
        except ValidationError as e:
            msg, param = validation_message(e)
            return error(wire, WireError(400, msg, param))
        except Exception as e:  # a bug of ours: still answer in the wire's shape, keep serving
            log.exception("internal error")
            return error(wire, WireError(500, f"internal server error: {type(e).__name__}: {e}"))

    async def session_request(request: Request, sid: str, model: Any) -> tuple[Any, Any, int]:
        s = session_for(request, sid)
        raw = await read_body(request, max_body_bytes)
        body = await parse_json(raw)
        if not isinstance(body, dict):
            raise WireError(400, "request body must be a JSON object")
        req = model.model_validate(body)
        req.check()
        return s, req, len(raw)

    def session_route(path: str, method: str = "POST") -> Callable[[Any], Any]:
        # a plain Starlette route: FastAPI's dependency solving costs more than a small request's work
        def register(fn: Callable[[str, Request], Any]) -> Callable[[str, Request], Any]:
            async def endpoint(request: Request) -> Response:
                out = await fn(request.path_params["sid"], request)
                return out if isinstance(out, Response) else JSONResponse(out)

            app.router.add_route(path, endpoint, methods=[method], include_in_schema=False)
            return fn

        return register

    @session_route("/s/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request) -> Any:
        async def handle() -> Any:
            s, req, size = await session_request(request, sid, ChatCompletionRequest)
            one = req.parallel_tool_calls is False and req.tools and req.allow_tool_calls  # stop after the first call
            params = params_of(req.temperature, req.top_p, req.top_k, req.seed, req.stops(),
                               [one_call_stop(s.ledger.tool_parser, tokenizer)] if one else ())
            pending = request_images(modality, policy, vision)
            msgs = req.internal_messages(pending)
            await checked(pending, size)
            msgs = match_tool_results(msgs, req.tool_result_fields())  # before the engine: a 400 naming the field
            turn = await run_turn(s, request, msgs, req.tools_openai(), params,
                                  req.max_completion_tokens or req.max_tokens, req.allow_tool_calls, size)
            if req.stream:
                usage = bool((req.stream_options or {}).get("include_usage"))
                return StreamingResponse(openai_stream(turn, tokenizer, model_name, usage), media_type="text/event-stream")
            return openai_response(turn, tokenizer, model_name)

        return await guarded("openai", handle)

    @session_route("/s/{sid}/v1/models", "GET")
    async def models(sid: str, request: Request) -> Any:
        async def handle() -> Any:
            session_for(request, sid)
            entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "molt", "type": "model",
                     "display_name": model_name, "created_at": "1970-01-01T00:00:00Z"}
            return {"object": "list", "data": [entry], "has_more": False, "first_id": model_name, "last_id": model_name}

        return await guarded("openai", handle)

    server = WireServer(app, tokenizer, model_name, session_route, session_request,
                        lambda: request_images(modality, policy, vision), checked, params_of, run_turn, guarded)
    for wire in app.state.wires.values():
        wire.mount(server)

    @app.post("/sessions")
    async def create_session(request: Request) -> Any:
        async def handle() -> Any:
            check_admin(request)
            body = await body_of(request, empty={})
            if not isinstance(body, dict):
                raise WireError(400, "request body must be a JSON object (or empty)")
            unknown = set(body) - {"rollout_id", "group_id", "chat_template_kwargs"}
            if unknown:
                raise WireError(400, f"unknown field(s) {sorted(unknown)}; allowed: rollout_id, group_id, chat_template_kwargs")
            for k in ("rollout_id", "group_id"):
                if k in body and not isinstance(body[k], str):
                    raise WireError(400, f"{k} must be a string", k)
            if not isinstance(body.get("chat_template_kwargs", {}), dict):
                raise WireError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
            try:
                info = store.create(body.get("rollout_id"), body.get("group_id", ""), body.get("chat_template_kwargs"))
            except Exception as e:  # a template that cannot render the probe, bad kwargs
                raise WireError(400, f"cannot open a session: {e}") from None
            return info.model_dump()

        return await guarded("openai", handle)

    @app.get("/sessions/{sid}/trajectory")
    async def get_trajectory(sid: str, request: Request) -> Any:
        async def handle() -> Any:
            check_admin(request)
            try:
                return store.trajectory(sid).model_dump(mode="json")
            except KeyError as e:
                raise WireError(404, e.args[0], code="session_not_found") from None

        return await guarded("openai", handle)

    @app.delete("/sessions/{sid}")
    async def delete_session(sid: str, request: Request) -> Any:
        async def handle() -> Any:
            check_admin(request)
            try:
                store.close(sid)
            except KeyError as e:
                raise WireError(404, e.args[0], code="session_not_found") from None
            return {"session_id": sid, "deleted": True}

        return await guarded("openai", handle)

    return app


class ServerHandle:
    """A running loopback server (:func:`start_server`): ``base_url``, ``admin_key``, ``app``, ``sessions``
    (:class:`SessionStore`), ``loop`` (the server's event loop, where the engine is called)."""

    def __init__(self, app: FastAPI, server: Any, thread: threading.Thread, base_url: str) -> None:
        self.app, self._server, self._thread, self.base_url = app, server, thread, base_url
        self.admin_key: str = app.state.admin_key
        self.sessions: SessionStore = app.state.sessions

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return getattr(self._server, "molt_loop", None)

    def create_session(self, rollout_id: str | None = None, group_id: str = "",
                       chat_template_kwargs: dict[str, Any] | None = None, seed: int | None = None) -> SessionInfo:
        """Open a session (Python API, no HTTP); see :meth:`SessionStore.create`."""
        return self.sessions.create(rollout_id, group_id, chat_template_kwargs, seed=seed)

    def trajectory(self, session_id: str, reward: float | None = None, **kwargs: Any) -> Trajectory:
        """The session's :class:`Trajectory`. Raises: KeyError for an unknown session."""
        return self.sessions.trajectory(session_id, reward, **kwargs)

    def close_session(self, session_id: str) -> Trajectory:
        """Remove the session; returns its final trajectory. Raises: KeyError."""
        return self.sessions.close(session_id)

    @property
    def running(self) -> bool:
        """True while the server thread is serving."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and join the server thread (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_in_thread(app: Any, host: str, port: int, name: str, lifespan: str = "off",
                    on_bind: Any = None) -> tuple[Any, threading.Thread, str]:
    """Serve ASGI ``app`` with uvicorn on ``host:port`` (0: a random free port) in a daemon thread;
    returns ``(server, thread, base_url)`` once it accepts. ``on_bind(base_url)`` runs before serving.

    Raises:
        OSError: the port cannot be bound.
        RuntimeError: the server did not start within 30 s.
    """
    import uvicorn

    # IPPROTO_TCP (not 0): asyncio then sets TCP_NODELAY on accepted connections
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    base_url = f"http://{host}:{sock.getsockname()[1]}"
    if on_bind is not None:
        on_bind(base_url)
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_keep_alive=30, backlog=2048)
    server = uvicorn.Server(config)

    def run() -> None:
        async def main() -> None:
            server.molt_loop = asyncio.get_running_loop()  # type: ignore[attr-defined]
            await server.serve(sockets=[sock])

        asyncio.run(main())

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > 30:
            raise RuntimeError(f"the {name} server did not start on {base_url}")
        time.sleep(0.01)
    return server, thread, base_url


def start_server(engine: Any, tokenizer: Any | None = None, admin_key: str | None = None, model_name: str = "policy",
                 port: int = 0, host: str = "127.0.0.1", **app_kwargs: Any) -> ServerHandle:
    """Serve :func:`create_app` on ``host:port`` (0: a random free port) in a daemon thread; returns once it accepts.

    Raises:
        OSError: the port cannot be bound.
        RuntimeError: the server did not start within 30 s.
    """
    app = create_app(engine, tokenizer, admin_key=admin_key, model_name=model_name, **app_kwargs)
    server, thread, base_url = serve_in_thread(app, host, port, "molt-server", lifespan="off",
                                               on_bind=lambda url: setattr(app.state.sessions, "base_url", url))
    return ServerHandle(app, server, thread, base_url)
