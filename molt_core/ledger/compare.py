"""How the ledger compares messages: field for field, tool-call arguments as JSON text, and a
returned reply against the one the wire sent; the deterministic tool-call id."""

from __future__ import annotations

import hashlib
import json
from typing import Any

def _chat_form(m: dict[str, Any]) -> dict[str, Any]:
    """A message as the compiled template sees it (``reasoning_content`` also as ``thinking``)."""
    return {"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m


def _calls(m: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(id, name, arguments as JSON text)`` per tool call of normalized message ``m``. Text,
    not the parsed dict: Python's ``==`` takes ``1``, ``1.0`` and ``true`` for one value and
    ignores key order, while a chat template renders each differently (``tojson``);
    ``json.dumps`` spells them apart and keeps the model's key order."""
    return [(c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
            for c in m.get("tool_calls", ())]


def _same_json(a: Any, b: Any) -> bool:
    """``a == b`` and the same JSON text (``1``, ``1.0`` and ``true`` apart, key order counts;
    see :func:`_calls`): tool schemas, which the template renders with ``tojson``."""
    return a == b and json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def _same_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Normalized message lists ``a == b`` field for field (content with its whitespace and
    think block, ``reasoning_content``, ``name``, ``tool_call_id``, call ids), tool-call
    arguments compared as JSON text (:func:`_calls`; skipped for one object twice -- the
    :class:`~molt_core.ledger.messages.NormalizeCache` hands back the previous request's
    objects for an unchanged prefix, so a request costs in proportion to its new messages)."""
    return a == b and all(x is y or _calls(x) == _calls(y) for x, y in zip(a, b) if "tool_calls" in x)


#: a committed turn's reply as the wires sent it: content, reasoning (None: none) and
#: :func:`_calls` of its tool calls
_Reply = tuple[str, str | None, list[tuple[str, str, str]]]

_REPLY_KEYS = frozenset(("role", "content", "reasoning_content", "tool_calls"))


def _echoes_reply(reply: _Reply, m: dict[str, Any]) -> bool:
    """``m`` (a normalized request message) is the assistant reply ``reply`` the wire sent,
    returned as received: the same content (exactly), the same reasoning or none (a client
    need not echo it: the ledger holds what the model produced), the same tool calls
    (:func:`_calls`, ids included) and no other field -- compared with the stored reply, never
    re-derived from the committed text (an unclosed ``<think>`` leaves the reply's content
    empty; issue 24 item 9). Any edit (whitespace, reasoning, an argument's type or key order)
    is no echo."""
    return (m["role"] == "assistant" and m["content"] == reply[0] and m.keys() <= _REPLY_KEYS
            and m.get("reasoning_content") in (None, reply[1]) and _calls(m) == reply[2])


def _call_id(prompt_ids: list[int], sampled_ids: list[int], k: int) -> str:
    """The id of tool call ``k`` (0-based) of the turn that sampled ``sampled_ids`` after
    ``prompt_ids``: ``"call_"`` + the first 24 hex digits of SHA-256 of
    ``"<prompt ids>|<sampled ids>|<k>"`` (ids comma-separated). A function of the tokens, never
    random: a template that renders ids (Mistral's ``call_id``) puts the same tokens in the
    next prompt on every run, so a resumed run samples what the uninterrupted one did."""
    key = f"{','.join(map(str, prompt_ids))}|{','.join(map(str, sampled_ids))}|{k}"
    return "call_" + hashlib.sha256(key.encode()).hexdigest()[:24]
