"""First-party tool-call parsers of the model families, registered through
``molt_register_tool_parsers`` (entry point ``molt_parsers``).

Each finds the calls in an assistant turn's visible text (the :class:`~molt_core.ledger.toolcall.ToolParser`
protocol); a block that is not a well-formed call stays content. Families, chosen by name:

* ``hermes`` / ``qwen`` (Hermes, Qwen2.5, Qwen3): the ledger's own default,
  :class:`~molt_core.ledger.toolcall.HermesParser`, ``<tool_call>{json}</tool_call>``.
* ``qwen3_coder`` (Qwen3-Coder XML): ``<tool_call><function=NAME><parameter=P>VALUE</parameter>
  ...</function></tool_call>`` (a block the generation ends in right after ``</function>`` counts,
  as a Hermes block cut after its JSON does: a stop on the close tag drops it from the text); a value is JSON-decoded unless the tool's schema declares the
  parameter a string (then the raw text, one leading/trailing newline removed).
* ``llama3_json`` (Llama 3.x): the whole visible text (after an optional ``<|python_tag|>``) is
  one JSON object ``{"name", "parameters"}`` or several separated by ``;``.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}``.
* ``auto``: the tokenizer's own response schema where transformers provides one
  (``tokenizer.response_template``, parsed by ``tokenizer.parse_response``); otherwise the
  family whose call syntax the chat template writes (``<function=`` -> ``qwen3_coder``,
  ``[TOOL_CALLS]`` -> ``mistral``, ``<|python_tag|>`` -> ``llama3_json``, else ``hermes``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from molt_core.hookspecs import Register, hookimpl
from molt_core.ledger.toolcall import (HermesParser, ParsedCall, ToolParser, call_of, calls_in, json_values, scan_blocks,
                                       skip_ws)
from molt_core.plugins import make_tool_parser

__all__ = ["ParsedCall", "ToolParser", "HermesParser", "Qwen3CoderParser", "Llama3JsonParser", "MistralParser",
           "TransformersResponseParser", "AutoParser", "TOOL_PARSERS", "get_tool_parser"]

_WS = " \t\r\n"
_FUNC = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")


class Qwen3CoderParser:
    """Qwen3-Coder's XML calls (see the module doc)."""

    def __init__(self, tags: tuple[str, str] = ("<tool_call>", "</tool_call>")) -> None:
        self.open, self.close = tags

    @staticmethod
    def _string_params(tools: list[dict[str, Any]] | None, name: str) -> set[str]:
        for t in tools or []:
            fn = t.get("function", t)
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
        return set()

    def _function(self, body: str, tools: list[dict[str, Any]] | None) -> tuple[str, dict[str, Any]] | None:
        m = _FUNC.match(body.strip(_WS))
        if m is None:
            return None
        inner = body.strip(_WS)[m.end():]
        if not inner.rstrip(_WS).endswith("</function>"):
            return None
        inner = inner.rstrip(_WS)[: -len("</function>")]
        name, strings, args = m.group(1).strip(), self._string_params(tools, m.group(1).strip()), {}
        i = 0
        while True:
            p = _PARAM.search(inner, i)
            if p is None:
                break
            # the value ends at the last </parameter> before the next <parameter= (or the end)
            nxt = _PARAM.search(inner, p.end())
            stop = nxt.start() if nxt else len(inner)
            close = inner.rfind("</parameter>", p.end(), stop)
            if close < 0:
                return None
            raw = inner[p.end():close]
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            if key in strings:
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except json.JSONDecodeError:
                    args[key] = raw
            i = close + len("</parameter>")
        return (name, args) if name else None

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """Every ``<tool_call><function=...>`` block that closes; others stay content."""
        return scan_blocks(text, start, self.open, lambda a: self._block(text, a, tools))

    def _block(self, text: str, a: int, tools: list[dict[str, Any]] | None) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        # a block ends at the first closing tag right after a </function> (values may hold tags)
        b = a + len(self.open)
        while True:
            c = text.find(self.close, b)
            if c < 0:  # the generation ended right after a </function> (a stop on the close tag): the block counts
                c = len(text)
                if not text.rstrip(_WS).endswith("</function>"):
                    return None
                call = self._function(text[a + len(self.open):], tools)
                return None if call is None else ([call], c)
            if text[:c].rstrip(_WS).endswith("</function>"):
                call = self._function(text[a + len(self.open): c], tools)
                return None if call is None else ([call], c + len(self.close))
            b = c + len(self.close)


class Llama3JsonParser:
    """Llama 3.x JSON calls: the text after ``start`` is nothing but ``;``-separated call objects
    (optionally after ``<|python_tag|>``)."""

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """All calls when the whole visible text is calls, else none."""
        a = i = skip_ws(text, start)
        if text.startswith("<|python_tag|>", i):
            i = skip_ws(text, i + len("<|python_tag|>"))
        objs, j = json_values(text, i, _WS + ";")
        calls = calls_in(objs, ("parameters", "arguments")) if skip_ws(text, j) == len(text) else None
        return [ParsedCall(n, args, (a, len(text))) for n, args in calls or []]


class MistralParser:
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``."""

    def __init__(self, tag: str = "[TOOL_CALLS]") -> None:
        self.tag = tag

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """The calls of every well-formed ``[TOOL_CALLS]`` block."""
        return scan_blocks(text, start, self.tag, lambda a: self._block(text, a))

    def _block(self, text: str, a: int) -> tuple[list[tuple[str, dict[str, Any]]], int] | None:
        objs, j = json_values(text, a + len(self.tag))
        calls = calls_in(objs)
        return None if calls is None else (calls, j)


class TransformersResponseParser:
    """The tokenizer's own response schema (transformers ``tokenizer.parse_response`` with its
    ``response_template``). Its calls follow the visible content, so their span runs from the
    end of the parsed content to the end of the text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, start: int = 0, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
        """The calls ``tokenizer.parse_response`` finds in ``text[start:]`` (none if it raises)."""
        try:
            msg = self.tokenizer.parse_response(text[start:], tools=tools)
        except Exception:  # noqa: BLE001 - text the schema does not match holds no call
            return []
        out = []
        content = msg.get("content") or "" if isinstance(msg, dict) else ""
        at = text.find(content, start) if content else -1
        a = at + len(content) if at >= 0 else start
        for c in (msg.get("tool_calls") or []) if isinstance(msg, dict) else []:
            call = call_of(c.get("function", c) if isinstance(c, dict) else None)
            if call is not None:
                out.append(ParsedCall(call[0], call[1], (a, len(text))))
        return out


class AutoParser(HermesParser):
    """``auto``: the parser for a model, picked from its tokenizer by :meth:`for_tokenizer` (see
    the module doc); built bare (no tokenizer known) it is Hermes, what ``auto`` picks then."""

    @staticmethod
    def for_tokenizer(tokenizer: Any) -> ToolParser:
        """The tokenizer's own response schema where transformers provides one, else the family
        whose call syntax its chat template writes (Hermes when none does)."""
        if tokenizer is not None and getattr(tokenizer, "response_template", None) and hasattr(tokenizer, "parse_response"):
            return TransformersResponseParser(tokenizer)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        for marker, name in (("<function=", "qwen3_coder"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")):
            if marker in template:
                return TOOL_PARSERS[name]()
        return HermesParser()


#: parser classes by model-family name, as registered (``create_app(tool_parser=...)``, ``molt serve --tool-parser``)
TOOL_PARSERS: dict[str, Any] = {
    "auto": AutoParser, "hermes": HermesParser, "qwen": HermesParser, "qwen3_coder": Qwen3CoderParser,
    "llama3_json": Llama3JsonParser, "mistral": MistralParser,
}


def get_tool_parser(name: str | ToolParser, tokenizer: Any = None) -> ToolParser:
    """The parser of :data:`TOOL_PARSERS` called ``name`` (``auto`` picks one for ``tokenizer``),
    or ``name`` itself when it is one (:func:`molt_core.plugins.make_tool_parser` over this table;
    the ledger's callers look names up in the registry instead: :func:`molt_core.plugins.tool_parser`).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    return make_tool_parser(name, tokenizer, TOOL_PARSERS)


@hookimpl
def molt_register_tool_parsers(register: Register) -> None:
    """Register the parsers of :data:`TOOL_PARSERS` (``auto``, ``hermes``, ``qwen``,
    ``qwen3_coder``, ``llama3_json``, ``mistral``)."""
    for name, parser_cls in TOOL_PARSERS.items():
        register(name, parser_cls)
