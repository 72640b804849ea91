"""Loopback ASGI server: OpenAI ``/v1/chat/completions`` and ``/v1/responses`` and Anthropic
``/v1/messages`` per session, each session recorded token-exactly by its
:class:`~molt_core.ledger.Ledger`.

``start_server(engine)`` runs it on 127.0.0.1 with a random port in a background thread and
returns a :class:`ServerHandle` (``base_url``, ``admin_key``, ``create_session()``,
``trajectory(sid)``, ``stop()``); ``create_app(engine)`` is the bare ASGI app.
``start_router(handles)`` puts one URL with the same API in front of several servers
(session affinity, new sessions to the least-loaded one; :mod:`molt_core.server.router`).
"""

from molt_core.server.app import ServerHandle, SessionInfo, SessionStore, create_app, start_server
from molt_core.server.router import RouterHandle, start_router

__all__ = ["ServerHandle", "SessionInfo", "SessionStore", "create_app", "start_server", "RouterHandle", "start_router"]
