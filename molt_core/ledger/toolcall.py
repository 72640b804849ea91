"""The ledger's tool-call protocol: a :class:`ToolParser` finds the calls in an assistant
turn's text, each with the character span of the block that held it; the ledger removes those
spans from the visible text. Text that is not a well-formed call stays content (a call is never
guessed).

The ledger's default is :class:`HermesParser` over its ``tool_call_tags`` (Hermes, Qwen2.5,
Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); the other model families'
parsers are plugins (``molt_register_tool_parsers``; first party: :mod:`molt_plugins.parsers`),
resolved by name by the ledger's callers (:func:`molt_core.plugins.tool_parser`) and handed in.
Parsing is JSON-aware: a closing tag inside a JSON string (``"text": "use </tool_call> to
close"``) does not end the call, and every call of a parallel-call turn is kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol

__all__ = ["ParsedCall", "ToolParser", "HermesParser", "skip_ws", "call_of", "calls_in", "json_values", "scan_blocks"]

_DEC = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass
class ParsedCall:
    """One tool call: ``name``, ``arguments`` (a dict) and ``span`` -- the ``(start, end)``
    characters of the block that held it (calls of one block share the span)."""

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


class ToolParser(Protocol):
    """What the ledger calls on each generated turn (``molt_register_tool_parsers``)."""

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """Every well-formed call in ``text[start:]``, in order (no exception on bad text).

        ``text``: the turn's decoded body (stop token/string removed); ``start``: where the
        visible text begins (after the think block, which the ledger splits with its
        ``think_tags``); ``tools``: the request's OpenAI-form schemas (None: none sent)."""
        ...


def skip_ws(text: str, i: int, chars: str = _WS) -> int:
    """The first index at or after ``i`` whose character is not in ``chars``."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def call_of(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of a decoded call object (arguments under the first of ``arg_keys``
    present, a dict or its JSON text), or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for k in arg_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def json_values(text: str, i: int, seps: str = _WS + ",") -> tuple[list[Any], int]:
    """Decode consecutive JSON values from ``text[i:]`` (separated by ``seps``); returns them and
    the index after the last one (and its separators)."""
    out = []
    while True:
        i = skip_ws(text, i, seps)
        if i >= len(text) or text[i] not in "[{":
            return out, i
        try:
            obj, j = _DEC.raw_decode(text, i)
        except ValueError:
            return out, i
        out.append(obj)
        i = j


def calls_in(objs: list[Any], arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[tuple[str, dict[str, Any]]] | None:
    """The ``(name, arguments)`` of decoded JSON values (a list among them spliced in: a block may
    hold one JSON array of calls), or None unless there is one and every value is a call."""
    calls = [call_of(x, arg_keys) for o in objs for x in (o if isinstance(o, list) else [o])]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def scan_blocks(text: str, start: int, tag: str,
                block: Callable[[int], tuple[list[tuple[str, dict[str, Any]]], int] | None]) -> list[ParsedCall]:
    """The calls of every block of ``text`` opening with ``tag`` at or after ``start``, in order:
    ``block(a)`` gives ``(calls, end)`` for the block opening at ``a`` (its span ``(a, end)``),
    or None for a malformed one, which stays content (the scan goes on after its tag)."""
    out: list[ParsedCall] = []
    i = start
    while True:
        a = text.find(tag, i)
        if a < 0:
            return out
        got = block(a)
        if got is None:
            i = a + len(tag)
            continue
        out += [ParsedCall(n, args, (a, got[1])) for n, args in got[0]]
        i = got[1]


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks, JSON-aware (see the module doc): a block may
    hold several JSON objects or one JSON array of them; a block the generation ended inside
    (no closing tag, only whitespace after the JSON) still counts.

    Args:
        tags: the opening and closing tag.
    """

    def __init__(self, tags: tuple[str, str] = ("<tool_call>", "</tool_call>")) -> None:
        self.open, self.close = tags

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """Every well-formed block's calls; a malformed block stays content."""
        return scan_blocks(text, start, self.open, lambda a: self._block(text, a))

    def _block(self, text: str, a: int) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        objs, j = json_values(text, a + len(self.open))
        j = skip_ws(text, j)
        if text.startswith(self.close, j):
            end = j + len(self.close)
        elif j >= len(text):  # the generation ended inside the block, after its JSON
            end = len(text)
        else:
            return None
        calls = calls_in(objs)
        return None if calls is None else (calls, end)
