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
    """``(id, name, arguments as JSON text)`` per tool call of ``m``: JSON text, because ``==`` takes
    ``1``, ``1.0`` and ``true`` for one value and ignores key order, which a template's ``tojson`` does not."""
    return [(c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
            for c in m.get("tool_calls", ())]


def _same_json(a: Any, b: Any) -> bool:
    """``a == b`` and the same JSON text (see :func:`_calls`): tool schemas."""
    return a == b and json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def _same_messages(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Normalized message lists equal field for field, tool-call arguments as JSON text (skipped for
    one object twice: the ``NormalizeCache`` hands back the previous request's objects)."""
    return a == b and all(x is y or _calls(x) == _calls(y) for x, y in zip(a, b) if "tool_calls" in x)


#: a committed turn's reply as the wires sent it: content, reasoning (or None), :func:`_calls`
_Reply = tuple[str, str | None, list[tuple[str, str, str]]]

_REPLY_KEYS = frozenset(("role", "content", "reasoning_content", "tool_calls"))


def _echoes_reply(reply: _Reply, m: dict[str, Any]) -> bool:
    """``m`` returns the stored ``reply`` as the wire sent it: same content, same reasoning or none,
    same tool calls (ids included), no other field; any edit is no echo (see docs/architecture.md)."""
    return (m["role"] == "assistant" and m["content"] == reply[0] and m.keys() <= _REPLY_KEYS
            and m.get("reasoning_content") in (None, reply[1]) and _calls(m) == reply[2])


def _call_id(prompt_ids: list[int], sampled_ids: list[int], k: int) -> str:
    """Tool call ``k``'s id: ``"call_"`` + 24 hex digits of SHA-256 of ``"<prompt ids>|<sampled ids>|<k>"``
    (deterministic, so a template that renders ids gives a resumed run the same prompt)."""
    key = f"{','.join(map(str, prompt_ids))}|{','.join(map(str, sampled_ids))}|{k}"
    return "call_" + hashlib.sha256(key.encode()).hexdigest()[:24]
