"""Request plumbing shared by the loopback server and the router: reading a JSON body under a byte
limit, refusing text that is not valid Unicode, answering 404/405 in the wire's error shape, and
abandoning work whose client went away. Nothing here lets a malformed request become a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from molt_core.server.wires import WireError, openai_error

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ClientDisconnected", "find_lone_surrogate", "parse_json", "read_body", "read_json", "wire_of_path",
           "error_body", "wire_error_response", "install_http_error_handlers", "until_disconnect"]

#: default request body limit in bytes (``create_app(max_body_bytes=...)``)
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: bodies above this many bytes are decoded off the event loop
_THREAD_DECODE_BYTES = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready (nothing is committed)."""


#: session paths of the first-party wire plugins -> the wire (a 404 names the missing plugin)
_PLUGIN_WIRES = {"/v1/responses": "OpenAI Responses", "/v1/messages": "Anthropic Messages"}


def wire_of_path(path: str, wires: Any = ()) -> Any:
    """The wire of ``wires`` whose ``owns(path)`` is true, else ``"openai"`` (the kernel's error shape)."""
    return next((w for w in wires if getattr(w, "owns", lambda _: False)(path)), "openai")


def error_body(wire: Any, status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An error body in ``wire``'s shape (its ``error_body``; the OpenAI shape for ``"openai"``)."""
    return getattr(wire, "error_body", openai_error)(status, message, param, code)


def wire_error_response(wire: Any, e: WireError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``e`` as a JSON response in ``wire``'s error shape (:func:`error_body`), status ``e.status``."""
    return JSONResponse(error_body(wire, e.status, e.message, e.param, e.code), status_code=e.status, headers=headers)


def find_lone_surrogate(obj: Any, path: str = "") -> tuple[str, int, str] | None:
    """The first string (keys included) of decoded JSON ``obj`` holding a lone UTF-16 surrogate, as
    ``(field path like messages[0].content, character index, "\\udXXX")``; None when all are valid Unicode."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, str):
            m = _SURROGATE.search(o)
            if m is not None:
                return p or "body", m.start(), f"\\u{ord(m.group()):04x}"
        elif isinstance(o, dict):
            items = list(o.items())
            for k, v in reversed(items):
                kp = f"{p}.{k}" if p else str(k)
                if isinstance(k, str) and _SURROGATE.search(k):
                    stack.append((k, p or "body"))
                stack.append((v, kp))
        elif isinstance(o, list):
            for i in range(len(o) - 1, -1, -1):
                stack.append((o[i], f"{p}[{i}]"))
    return None


def _decode(raw: bytes) -> Any:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise WireError(400, f"request body is not valid JSON: {e}") from None
    bad = find_lone_surrogate(obj)
    if bad is not None:
        where, i, ch = bad
        raise WireError(400, f"{where} holds a lone UTF-16 surrogate ({ch}) at character {i}: that is not valid "
                             "Unicode text. Send UTF-8 text (a surrogate escape must come as a high+low pair)",
                        where, "invalid_unicode")
    return obj


async def read_body(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """``request``'s body, enforcing ``limit`` bytes while reading (and on ``Content-Length`` before).
    Raises: WireError -- 413 (``code`` ``request_too_large``) over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WireError(413, f"request body is {int(declared)} bytes; the limit is {limit}", code="request_too_large")
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise WireError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        parts.append(chunk)
    return b"".join(parts)


async def read_json(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES, empty: Any = ...) -> Any:
    """:func:`read_body` decoded by :func:`parse_json` (an empty body returns ``empty`` when given).

    Raises:
        WireError: 413 over ``limit``; 400 for invalid JSON, too-deep nesting, or a lone
            surrogate (``param`` names the field, ``code`` ``invalid_unicode``).
    """
    return await parse_json(await read_body(request, limit), empty)


async def parse_json(raw: bytes, empty: Any = ...) -> Any:
    """Decode body ``raw`` as JSON (off the event loop over 1 MiB), refusing lone surrogates.
    Raises: WireError -- 400 for invalid JSON, too-deep nesting, or a lone surrogate."""
    if empty is not ... and not raw.strip():
        return empty
    if len(raw) > _THREAD_DECODE_BYTES:
        return await asyncio.to_thread(_decode, raw)
    return _decode(raw)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first, which cancels it. Call after the body is read.
    Raises: ClientDisconnected -- the client went away before ``work`` finished."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the cancelled work's outcome is discarded
        pass
    raise ClientDisconnected("the client disconnected before the answer was ready")


def _not_found_hint(path: str) -> str:
    return (f"no route {path}: this server gives every session its own base URL. Open a session with "
            "POST /sessions (admin key), then point the OpenAI SDK at its openai_base_url "
            "(<server>/s/<session_id>/v1) or the Anthropic SDK at its anthropic_base_url "
            "(<server>/s/<session_id>), with the session's api_key")


def install_http_error_handlers(app: FastAPI) -> None:
    """Answer the framework's own errors (404, 405, ...) in the wire's error shape; a 404 outside
    ``/s/{sid}/`` says how to open a session, one on an unmounted plugin wire's path names the plugin."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path, wires = request.url.path, getattr(app.state, "wires", {})
        served = ["/v1/chat/completions", *(p for w in wires.values() for p in getattr(w, "paths", ())), "/v1/models"]
        missing = next((w for p, w in _PLUGIN_WIRES.items() if path.rstrip("/").endswith(p) and p not in served), None)
        if exc.status_code == 404 and not path.startswith("/s/"):
            msg, code = _not_found_hint(path), "not_found"
        elif exc.status_code == 404 and missing:
            msg = (f"no route {path}: the {missing} wire is not loaded (no plugin registered it through "
                   "molt_register_wires); enable molt_plugins.wires (unset MOLT_DISABLE_PLUGINS=molt_wires, or "
                   "reinstall molt-sdk from its checkout) or use /v1/chat/completions")
            code = "not_found"
        elif exc.status_code == 404:
            msg, code = f"no route {path} (a session serves {', '.join(served[:-1])} and {served[-1]})", "not_found"
        elif exc.status_code == 405:
            msg, code = f"method {request.method} is not allowed on {path}", "method_not_allowed"
        else:
            msg, code = str(exc.detail), None
        return wire_error_response(wire_of_path(path, wires.values()), WireError(exc.status_code, msg, code=code),
                                   headers=getattr(exc, "headers", None))
