"""Chat messages as the ledger reads them: validation, canonical form, a prefix cache.

:func:`normalize_messages` turns a request's messages (OpenAI form, content parts, string or
object tool-call arguments) into the canonical form the ledger renders and compares;
:class:`NormalizeCache` does the same while reusing the previous request's work for the
unchanged prefix a chat client re-sends each turn, so reading a request costs in proportion to
its new messages (plus one C-level comparison of the prefix)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["normalize_messages", "NormalizeCache"]

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
        return "".join(out)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.arguments is not valid JSON ({e.msg}); send the JSON object the model produced") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.arguments must be a JSON object, got {type(args).__name__}")
    return args


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Canonical OpenAI-style chat messages for rendering and comparison.

    Each message becomes ``{"role", "content": str}`` plus, where present, ``tool_calls``
    (``[{"id", "type": "function", "function": {"name", "arguments": dict}}]``; string
    arguments are parsed), ``tool_call_id``, ``name`` and ``reasoning_content``. Content
    parts are joined when all are text.

    Raises:
        ValueError: naming ``messages[i].<field>`` -- not a list of objects, unknown role,
            non-text content, a tool call without a name, arguments that are not a JSON object.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of message objects, got {type(messages).__name__}")
    return [_normalize_one(m, i) for i, m in enumerate(messages)]


def _normalize_one(m: Any, i: int) -> dict[str, Any]:
    """``messages[i]`` normalized (see :func:`normalize_messages`)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}")
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)}
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list and only on assistant messages")
        norm = []
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = c.get("function", c) if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"{w}.function.name must be a non-empty string")
            norm.append({"id": str(c.get("id") or ""), "type": "function",
                         "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}), f"{w}.function")}})
        msg["tool_calls"] = norm
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(m.get(key), str):
            msg[key] = m[key]
    return msg


class _Unfrozen(Exception):
    pass


_UNCACHED = object()  # compares unequal to every message: the prefix match stops there


def _freeze(x: Any) -> Any:
    if x is None or type(x) is str:
        return x
    if type(x) is list:
        return [_freeze(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: _freeze(v) for k, v in x.items()}
    raise _Unfrozen


def _frozen(m: Any) -> Any:
    """A private deep copy of raw message ``m`` that compares ``==`` to a later message only if
    that message normalizes identically, else :data:`_UNCACHED`.

    Only ``None``, ``str``, ``list`` and ``dict`` (string keys) are kept: for those, ``==`` is
    value identity (``1 == True`` and ``1 == 1.0`` cannot arise). Tool-call arguments given as an
    object are refused too, since their key order reaches the rendered JSON but not ``==``."""
    try:
        fz = _freeze(m)
    except _Unfrozen:
        return _UNCACHED
    for c in (fz.get("tool_calls") or []) if isinstance(fz, dict) and isinstance(fz.get("tool_calls"), list) else []:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
            return _UNCACHED
    return fz


class NormalizeCache:
    """:func:`normalize_messages` with the previous call's longest equal prefix reused.

    Each call compares the request's messages with private frozen copies of the previous
    call's raw messages (one list comparison, in C) and normalizes only the messages after the
    first difference; the result is exactly ``normalize_messages(messages)`` (see
    :func:`_frozen` for why ``==`` is safe here) and raises the same errors, with the same
    ``messages[i]`` names. Safe to call from several threads (a race only loses the reuse).
    """

    def __init__(self) -> None:
        self._state: tuple[list[Any], list[dict[str, Any]]] = ([], [])

    def __call__(self, messages: Any) -> list[dict[str, Any]]:
        """Normalize ``messages``; raises ValueError like :func:`normalize_messages`."""
        if not isinstance(messages, list):
            return normalize_messages(messages)
        raw, norm = self._state
        n = min(len(raw), len(messages))
        p = n if messages[:n] == raw[:n] else 0
        while p < n and messages[p] == raw[p]:
            p += 1
        out = norm[:p] + [_normalize_one(messages[i], i) for i in range(p, len(messages))]
        self._state = (raw[:p] + [_frozen(m) for m in messages[p:]], list(out))
        return out
