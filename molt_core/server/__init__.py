"""Loopback ASGI server: OpenAI ``/v1/chat/completions`` per session and every registered wire
plugin's routes (``molt_register_wires``; first-party: OpenAI ``/v1/responses`` and Anthropic
``/v1/messages``, :mod:`molt_plugins.wires`), each session recorded token-exactly by its
:class:`~molt_core.ledger.Ledger`.

``start_server(engine)`` runs it on 127.0.0.1 with a random port in a background thread and
returns a :class:`ServerHandle` (``base_url``, ``admin_key``, ``create_session()``,
``trajectory(sid)``, ``stop()``); ``create_app(engine)`` is the bare ASGI app.
``molt serve --num-engines N`` puts one URL in front of several servers
(:mod:`molt_core.cli.router`).
"""

from molt_core.server.app import ServerHandle, SessionInfo, SessionStore, create_app, start_server

__all__ = ["ServerHandle", "SessionInfo", "SessionStore", "create_app", "start_server"]
