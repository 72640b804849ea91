"""The ledger's tool-call protocol: a :class:`ToolParser` finds the calls in a turn's text, each with
its block's span (removed from the visible text; a malformed call stays content). The default is
the JSON-aware :class:`HermesParser`; other families' are plugins (``molt_register_tool_parsers``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol

__all__ = ["ParsedCall", "ToolParser", "HermesParser", "skip_ws", "call_of", "calls_in", "json_values", "scan_blocks"]

_DEC = json.JSONDecoder()
_WS = " \t\r\n"


@dataclass
class ParsedCall:
    """One tool call: ``name``, ``arguments`` (a dict), ``span`` (``(start, end)`` of its block)."""

    name: str
    arguments: dict[str, Any]
    span: tuple[int, int]


class ToolParser(Protocol):
    """What the ledger calls on each generated turn (``molt_register_tool_parsers``)."""

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """Every well-formed call in ``text[start:]`` (the decoded body; ``start``: after the think
        block), in order, never raising; ``tools``: the request's OpenAI-form schemas or None."""
        ...


def skip_ws(text: str, i: int, chars: str = _WS) -> int:
    """The first index at or after ``i`` whose character is not in ``chars``."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def call_of(obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of a decoded call object (arguments under the first ``arg_keys`` key), or None."""
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
    """Consecutive JSON values of ``text[i:]`` (separated by ``seps``) and the index after them."""
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
    """``(name, arguments)`` of decoded JSON values (arrays spliced in), or None unless all are calls."""
    calls = [call_of(x, arg_keys) for o in objs for x in (o if isinstance(o, list) else [o])]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def scan_blocks(text: str, start: int, tag: str,
                block: Callable[[int], tuple[list[tuple[str, dict[str, Any]]], int] | None]) -> list[ParsedCall]:
    """The calls of every block opening with ``tag`` at or after ``start``: ``block(a)`` gives
    ``(calls, end)`` for the block at ``a``, or None for a malformed one (it stays content)."""
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
    """``<tool_call>{json}</tool_call>`` blocks (several objects or one array each; a block cut off
    after its JSON counts). ``tags``: the opening and closing tag."""

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
