"""Loopback ASGI server: OpenAI ``/v1/chat/completions`` per session and every registered wire
plugin's routes (``molt_register_wires``), each session recorded token-exactly by its
:class:`~molt_core.ledger.Ledger`. ``start_server(engine)`` runs it on 127.0.0.1 (random port) in a
background thread and returns a :class:`ServerHandle`; ``create_app(engine)`` is the bare ASGI app.
"""

from molt_core.server.app import ServerHandle, SessionInfo, SessionStore, create_app, start_server

__all__ = ["ServerHandle", "SessionInfo", "SessionStore", "create_app", "start_server"]
