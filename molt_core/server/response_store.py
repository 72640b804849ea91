"""The Responses wire's stored responses (``store`` / ``previous_response_id``), per session.

OpenAI semantics (Responses API reference, ``previous_response_id`` and ``instructions``): a
response created with ``store`` true -- the default here as at OpenAI -- can be continued by a
later request naming it as ``previous_response_id``; the server prepends that response's input
items and output items to the new input. The earlier request's ``instructions`` are not
carried over (the new request's, if any, open the prompt), nor are its ``tools``.

What is stored is the session ledger's committed conversation as of that response (its
:attr:`~molt_core.ledger.Ledger.history`: chat messages, the assistant turn as the model
produced it, images as SHA-256 parts of the rollout's pool), never token ids: a continuation
hands the ledger exactly the history it committed plus the new items, so when the response is
the session's latest the ledger *extends* the open segment (earlier prompt ids + the sampled
ids + the rendered new items, nothing re-encoded) like a client that re-sent the whole input.

Bounded: a session keeps its ``max_items`` most recently used stored responses (older ones are
evicted and answer 404 like unknown ids); consecutive responses share their common message
objects, so memory grows with the conversation, not with its square. The store belongs to the
session and is freed with it.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

from molt_core.server.responses import ResponsesRequest
from molt_core.server.wires import WireError

__all__ = ["MAX_STORED_RESPONSES", "ResponseStore"]

#: stored responses kept per session (the most recently used)
MAX_STORED_RESPONSES = 64


class ResponseStore:
    """The stored responses of one session: response id -> the conversation as of it.

    Args:
        max_items: how many stored responses to keep (least recently used evicted first).

    Raises:
        ValueError: ``max_items`` below 1.

    Not thread-safe: the server uses it on its event loop only.
    """

    def __init__(self, max_items: int = MAX_STORED_RESPONSES) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        self.max_items = max_items
        self._items: OrderedDict[str, tuple[dict[str, Any], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def continued(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of ``req`` (``messages``: :meth:`ResponsesRequest.openai_messages`)
        with the conversation of ``req.previous_response_id`` inserted after the instructions'
        system message (``messages`` unchanged when it is None).

        Raises:
            WireError: 404 (param ``previous_response_id``, code ``previous_response_not_found``,
                as OpenAI names it) when the id is not stored in this session: unknown, from
                another session, created with ``store: false``, or evicted.
        """
        rid = req.previous_response_id
        if rid is None:
            return messages
        chain = self._items.get(rid)
        if chain is None:
            raise WireError(404, f"Previous response with id {rid!r} not found in this session (a response is "
                                 f"stored unless created with store=false; a session keeps its last {self.max_items}). "
                                 "Send the whole conversation as input instead", "previous_response_id",
                            "previous_response_not_found")
        self._items.move_to_end(rid)
        k = 1 if req.instructions else 0  # openai_messages puts the instructions first
        return messages[:k] + list(chain) + messages[k:]

    def record(self, req: ResponsesRequest, history: list[dict[str, Any]]) -> str:
        """A new response id for the turn just committed for ``req``; with ``req.store`` not
        False, ``history`` (the ledger's :attr:`~molt_core.ledger.Ledger.history` right after
        that commit) is stored under it without the instructions' system message."""
        rid = "resp_" + uuid.uuid4().hex
        if req.store is False:
            return rid
        chain = history[1:] if req.instructions else history
        last = next(reversed(self._items.values()), ())
        n = len(last)
        # share the message objects the newest stored response already holds (a chat grows by a suffix)
        self._items[rid] = last + tuple(chain[n:]) if n and list(last) == chain[:n] else tuple(chain)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)
        return rid
