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

Item ids (OpenAI's rule): each stored response also keeps the ``id`` of every item it holds --
its output items' and those of the inputs it continues -- and a continuation whose input repeats
one is a 400 ``Duplicate item found with id ...`` (param ``input``), as OpenAI answers it, never a
conversation holding that item twice; send only the new items.

Bounded: a session keeps its ``max_items`` most recently used stored responses (older ones are
evicted and answer 404 like unknown ids); consecutive responses share their common message
objects, so memory grows with the conversation, not with its square. The store belongs to the
session and is freed with it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from molt_core.server.wires import WireError

if TYPE_CHECKING:  # annotations only: the Responses wire imports this module
    from molt_plugins.wires.responses import ResponsesRequest

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
        # response id -> (the conversation's messages, the ids of the items it holds)
        self._items: OrderedDict[str, tuple[tuple[dict[str, Any], ...], frozenset[str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def continued(self, req: ResponsesRequest, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages of ``req`` (``messages``: :meth:`ResponsesRequest.openai_messages`)
        with the conversation of ``req.previous_response_id`` inserted after the instructions'
        system message (``messages`` unchanged when it is None).

        Raises:
            WireError: 404 (param ``previous_response_id``, code ``previous_response_not_found``,
                as OpenAI names it) when the id is not stored in this session: unknown, from
                another session, created with ``store: false``, or evicted; 400 (param ``input``,
                OpenAI's message) when an input item's ``id`` is one the stored response holds.
        """
        rid = req.previous_response_id
        if rid is None:
            return messages
        stored = self._items.get(rid)
        if stored is None:
            raise WireError(404, f"Previous response with id {rid!r} not found in this session (a response is "
                                 f"stored unless created with store=false; a session keeps its last {self.max_items}). "
                                 "Send the whole conversation as input instead", "previous_response_id",
                            "previous_response_not_found")
        chain, held = stored
        for i, item_id in _input_ids(req):
            if item_id in held:
                raise WireError(400, f"Duplicate item found with id {item_id}. Remove duplicate items from your input "
                                     f"and try again (input[{i}] is an item of the previous response {rid}: send only "
                                     "the new items)", "input")
        self._items.move_to_end(rid)
        k = 1 if req.instructions else 0  # openai_messages puts the instructions first
        return messages[:k] + list(chain) + messages[k:]

    def record(self, req: ResponsesRequest, history: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """Store ``response`` (the ``response`` object answering ``req``: its ``id`` and its
        ``output`` items' ids are read) unless ``req.store`` is False: ``history`` (the ledger's
        :attr:`~molt_core.ledger.Ledger.history` right after the turn's commit) without the
        instructions' system message, and the ids of the items it holds (``req.input``'s, the
        output's, and those of the continued response, if still stored)."""
        if req.store is False:
            return
        chain = history[1:] if req.instructions else history
        parent = self._items.get(req.previous_response_id or "")
        held = (parent[1] if parent else frozenset()) | {i for _, i in _input_ids(req)} | {
            o["id"] for o in response["output"]}
        last = next(reversed(self._items.values()), ((), frozenset()))[0]
        n = len(last)
        # share the message objects the newest stored response already holds (a chat grows by a suffix)
        self._items[response["id"]] = (last + tuple(chain[n:]) if n and list(last) == chain[:n] else tuple(chain), held)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)


def _input_ids(req: ResponsesRequest) -> list[tuple[int, str]]:
    """``(i, id)`` of each ``req.input[i]`` item that carries a string ``id``."""
    items = [] if isinstance(req.input, str) else req.input
    return [(i, it["id"]) for i, it in enumerate(items) if isinstance(it, dict) and isinstance(it.get("id"), str)]
