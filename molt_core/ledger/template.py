"""The chat template's facts for one ledger: the compiled render, the assistant turn's close and
body prefix, the stop ids (derived once per tokenizer, template and template kwargs), and the
encode cache of template text."""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

from molt_core.ledger.compare import _chat_form
from molt_core.ledger.render import Prover, WindowMessages, WindowProof

__all__ = ["TemplateFacts"]

_PROBE_USER = "molt-ledger-probe-user"
_PROBE_ASSISTANT = "molt-ledger-probe-assistant"

#: (id(tokenizer), chat template, template kwargs, prover) -> facts derived by Ledger._fast_render/_probe
_TEMPLATE_FACTS: dict[tuple[int, str, str], tuple[Any, ...]] = {}

#: per tokenizer: template text -> its ids (:meth:`Ledger._encode`), at most ``_ENCODED_MAX``
#: texts each, oldest dropped first
_ENCODED: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_ENCODED_MAX = 4096
_ENCODED_LOCK = threading.Lock()


class TemplateFacts:
    """The template half of :class:`~molt_core.ledger.Ledger` (a mixin: it reads the ledger's
    ``tokenizer`` and ``template_kwargs``)."""

    def _template_facts(self, prover: Prover | None) -> WindowProof | None:
        """Set the template facts (``_compiled``, ``_template_vars``, ``turn_close``,
        ``body_prefix``, ``stop_token_ids``), derived once per (tokenizer, chat template, template
        kwargs, prover), and return ``prover``'s window proof (None: no proven window)."""
        tokenizer = self.tokenizer
        # the template facts depend only on the tokenizer and template kwargs: derive them once
        key = (id(tokenizer), tokenizer.chat_template, json.dumps(self.template_kwargs, sort_keys=True, default=str), prover)
        facts = _TEMPLATE_FACTS.get(key)
        if facts is None:
            self._fast_render()
            self._probe()
            compiled: Any = getattr(self, "_compiled", None)
            proof = prover(tokenizer.chat_template, compiled.environment)[0] if compiled is not None and prover else None
            facts = (self._compiled, getattr(self, "_template_vars", {}), self.turn_close, self.body_prefix,
                     self.stop_token_ids, proof)
            _TEMPLATE_FACTS[key] = facts
        self._compiled, self._template_vars, self.turn_close, self.body_prefix, self.stop_token_ids, proof = facts
        return proof

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (with ``tools`` and the session's template kwargs).

        Same text as ``tokenizer.apply_chat_template(..., tokenize=False)`` (checked on a probe
        conversation at construction), rendered through the compiled template directly when
        possible: the messages here are already plain dicts, so the wrapper's conversions are
        skipped (about 3x faster on long conversations).

        Raises:
            ValueError: the template refused the messages (its ``raise_exception``).
        """
        from jinja2 import TemplateError

        try:
            if self._compiled is not None:
                return self._compiled.render(messages=[_chat_form(m) for m in messages], tools=tools or None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._template_vars)
            return self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **self.template_kwargs)
        except TemplateError as e:  # e.g. the template's raise_exception("roles must alternate")
            raise ValueError(f"the chat template cannot render these messages: {e}") from None

    def _fast_render(self) -> None:
        self._compiled = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(self.tokenizer.chat_template)
        except Exception:  # another transformers version or a template only the wrapper handles
            return
        self._template_vars = {**getattr(self.tokenizer, "special_tokens_map", {}), **self.template_kwargs}
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": _PROBE_USER},
                 {"role": "assistant", "content": _PROBE_ASSISTANT, "reasoning_content": "r",
                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
                 {"role": "tool", "content": "t"}, {"role": "user", "content": "u"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        slow = self.tokenizer.apply_chat_template(probe, tools=tools, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)
        self._compiled = compiled
        try:
            same = self.render(probe, tools) == slow
        except Exception:
            same = False
        if not same:
            self._compiled = None

    def _probe(self) -> None:
        """Derive the assistant-turn header, close and generation-prompt body prefix by
        rendering a probe conversation (no hard-coded ChatML)."""
        u = [{"role": "user", "content": _PROBE_USER}]
        ua = u + [{"role": "assistant", "content": _PROBE_ASSISTANT}]
        r_u, r_ug, r_ua = self.render(u, add_generation_prompt=False), self.render(u), self.render(ua, add_generation_prompt=False)
        self.turn_close: str | None = None
        self.body_prefix = ""
        if r_ua.startswith(r_u) and _PROBE_ASSISTANT in r_ua[len(r_u):]:
            turn = r_ua[len(r_u):]
            i = turn.index(_PROBE_ASSISTANT)
            header, self.turn_close = turn[:i], turn[i + len(_PROBE_ASSISTANT):]
            gen = r_ug[len(r_u):] if r_ug.startswith(r_u) else ""
            if gen.startswith(header):
                self.body_prefix = gen[len(header):]
        tok = self.tokenizer
        stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        if self.turn_close:
            first = self._encode(self.turn_close)[:1]
            if first and first[0] in set(getattr(tok, "all_special_ids", [])):
                stops.add(first[0])
        #: token ids that end an assistant turn (pass them to the engine as ``stop_token_ids``)
        self.stop_token_ids = sorted(stops)

    def _encode(self, text: str) -> list[int]:
        """Tokenize template / new-message text (never generated text). Encoding is a pure
        function of (tokenizer, text): the ids of a recent text are reused (the
        ``n_samples_per_prompt`` rollouts of a group render the same prompt; issue 16 item 2)."""
        if not text:
            return []
        cache = _ENCODED.get(self.tokenizer)
        if cache is None:
            with _ENCODED_LOCK:
                cache = _ENCODED.setdefault(self.tokenizer, {})
        ids = cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            with _ENCODED_LOCK:  # sessions of the loopback server run on several threads
                if len(cache) >= _ENCODED_MAX:
                    cache.pop(next(iter(cache)))  # the oldest entry (dicts keep insertion order)
                cache[text] = ids
        return list(ids)

    def _render_window(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        """:meth:`render` of a window, its message list refusing negative subscripts
        (:class:`~molt_core.ledger.render.NegativeIndex`); template errors propagate as raised."""
        assert self._compiled is not None
        return self._compiled.render(messages=WindowMessages(_chat_form(m) for m in messages), tools=tools or None,
                                     documents=None, add_generation_prompt=add_generation_prompt, **self._template_vars)
