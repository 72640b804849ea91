"""Planning one request of a session (:meth:`Ledger.prepare`, pure: nothing changes until
:meth:`~molt_core.ledger.Ledger.commit`). Modes: **start** (the first request), **extend** (the
request repeats the committed history and the template keeps it: the prompt is the held ids + the
tokenized tail), **rewrite** (anything else: the open segment is sealed, a new one starts from the
full render), **retry** (the last request again: its cached turn). Details: docs/architecture.md."""

from __future__ import annotations

import weakref
from typing import Any

from molt_core.ledger.compare import _chat_form, _echoes_reply, _same_json, _same_messages
from molt_core.ledger.messages import image_shas
from molt_core.ledger.records import Prepared, PromptTooLong
from molt_core.ledger.render import window_start
from molt_core.types import ImageRef, SamplingParams

__all__ = ["Planning", "expand_images", "extra_image_tokens", "max_token_bytes"]

_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def expand_images(vision: Any, ids: list[int], shas: list[str], pool: dict[str, bytes],
                  offset: int) -> tuple[list[int], list[ImageRef]]:
    """``ids`` with each image placeholder expanded into its run, and the runs' refs (``vision.expand``).

    Raises:
        ValueError: images and no vision processor, or as ``vision.expand``.
    """
    if vision is None:
        if shas:
            raise ValueError(f"the messages carry {len(shas)} image(s) but this model has no vision processor; "
                             "serve a vision-language model (see docs/vision.md) or send text only")
        return ids, []
    return vision.expand(ids, shas, pool, offset)


def extra_image_tokens(vision: Any, shas: list[str], pool: dict[str, bytes]) -> int:
    """Tokens the images ``shas`` add to a render by expansion (``vision.extra_tokens``); 0 for none."""
    return vision.extra_tokens(shas, pool) if vision is not None and shas else 0


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the characters one token of ``tokenizer`` stands for: its longest vocabulary
    entry in UTF-8 bytes (so ``c`` characters are at least ``ceil(c / bound)`` tokens); 2**20 when
    the vocabulary cannot be read. Cached per tokenizer."""
    try:
        return _MAX_TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        bound = max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()) or 1 << 20
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary
        bound = 1 << 20
    try:  # by object, never by id: a freed tokenizer's id is reused
        _MAX_TOKEN_BYTES[tokenizer] = bound
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return bound


class Planning:
    """The planning half of :class:`~molt_core.ledger.Ledger` (a mixin over the session's state):
    :meth:`prepare` and the extend check."""

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                params: SamplingParams | None = None, max_prompt_tokens: int | None = None,
                fresh: bool = False, allow_tool_calls: bool = True) -> Prepared:
        """Plan a request without changing the ledger (see the module doc for the modes).

        Args:
            messages: the request's chat messages (OpenAI form; normalized here).
            tools: OpenAI-form tool schemas (``[{"type": "function", "function": {...}}]``).
            params: sampling settings (part of the retry key only).
            max_prompt_tokens: refuse a prompt of this many tokens or more (the context length);
                checked by a lower bound (:func:`max_token_bytes`) before tokenizing, exactly after.
            fresh: never answer from the cached turn (identical messages then make a rewrite).
            allow_tool_calls: False for ``tool_choice: none`` (part of the retry key).

        Returns:
            A :class:`Prepared` (send ``prompt_ids`` to the engine; a rewrite's ``reencoded``: :meth:`_reencoded`).

        Raises:
            ValueError: malformed messages (see :func:`normalize_messages`) or no messages.
            PromptTooLong: the prompt has ``max_prompt_tokens`` tokens or more (a ValueError).
        """
        msgs = self._normalize(messages)
        if not msgs:
            raise ValueError("messages is empty; send at least one message")
        tools = tools or None
        key = (msgs, tools, params.model_dump() if params else None, allow_tool_calls)
        with self._lock:
            epoch = self._epoch
            last = self._last_req
            if (self._last_turn is not None and key == last and not fresh and last is not None
                    and _same_messages(msgs, last[0]) and _same_json(tools, last[1])):
                return Prepared("retry", [], [], msgs, tools, self._last_prompt_text, key, epoch, cached=self._last_turn)
            ext = self._try_extend(msgs, tools, max_prompt_tokens)
            if not isinstance(ext, str):
                text, tail = ext
                o = self._open
                new = msgs[len(self._history):]
                tail, refs = expand_images(self.vision, tail, image_shas(new), self._images, len(o.token_ids))
                self._check_fits(len(o.token_ids) + len(tail), max_prompt_tokens)
                return Prepared("extend", o.token_ids + tail, tail, self._history + new, tools, text, key, epoch,
                                allow_tool_calls=allow_tool_calls, image_refs=refs,
                                images=[self._images[r.sha256] for r in o.images + refs])
            text = self.render(msgs, tools)
            self._check_fits_text(0, text, max_prompt_tokens)
            ids, refs = expand_images(self.vision, self._encode(text), image_shas(msgs), self._images, 0)
            self._check_fits(len(ids), max_prompt_tokens)
            images = [self._images[r.sha256] for r in refs]
            if not self._open.token_ids:
                return Prepared("start", ids, list(ids), msgs, tools, text, key, epoch, allow_tool_calls=allow_tool_calls,
                                images=images, image_refs=refs)
            return Prepared("rewrite", ids, list(ids), msgs, tools, text, key, epoch,
                            reencoded=self._reencoded(msgs, tools, len(ids)), allow_tool_calls=allow_tool_calls,
                            images=images, image_refs=refs, cause=ext)

    def _check_fits_text(self, held: int, text: str, limit: int | None) -> None:
        """Pre-tokenization check: ``held`` ids + at least ``ceil(len(text) / max_token_bytes)``."""
        if limit is None:
            return
        low = held + -(-len(text) // max_token_bytes(self.tokenizer))
        if low >= limit:
            raise PromptTooLong(f"the prompt is at least {low} tokens ({len(text)} characters, at most "
                                f"{max_token_bytes(self.tokenizer)} per token); the model's context is {limit} tokens. "
                                "Shorten the conversation (or compact it)", low, limit, True)

    @staticmethod
    def _check_fits(n: int, limit: int | None) -> None:
        if limit is not None and n >= limit:
            raise PromptTooLong(f"the prompt is {n} tokens; the model's context is {limit} tokens. "
                                "Shorten the conversation (or compact it)", n, limit, False)

    def _reencoded(self, msgs: list[dict[str, Any]], tools: Any, prompt_len: int) -> int:
        """Rendered tokens of the request messages that repeat committed history (matched in order as
        a subsequence), images' expansion included; ``prompt_len`` when a prefix cannot render."""
        hist = self._history
        matched: list[int] = []
        j = 0
        for i, m in enumerate(msgs):
            for jj in range(j, len(hist)):
                if self._echoes(jj, m):
                    matched.append(i)
                    j = jj + 1
                    break
        if not matched:
            return 0
        lens: dict[int, int] = {0: 0}

        def upto(k: int) -> int:
            if k not in lens:
                lens[k] = len(self._encode(self.render(msgs[:k], tools, add_generation_prompt=False)))
            return lens[k]

        try:
            return sum(max(0, upto(i + 1) - upto(i)) + extra_image_tokens(self.vision, image_shas(msgs[i:i + 1]), self._images)
                       for i in matched)
        except ValueError:  # the template refuses a prefix (e.g. must end on a user turn)
            return prompt_len

    def _echoes(self, i: int, m: dict[str, Any]) -> bool:
        """Request message ``m`` repeats history message ``i``, as committed or as the wire sent it."""
        reply = self._replies.get(i)
        return _same_messages([self._history[i]], [m]) or (reply is not None and _echoes_reply(reply, m))

    def _try_extend(self, msgs: list[dict[str, Any]], tools: Any,
                    max_prompt_tokens: int | None = None) -> tuple[str, list[int]] | str:
        """``(new prompt text, tail ids)`` when ``msgs`` extends the history, else a :data:`REWRITE_CAUSES` entry."""
        hist = self._history
        k = len(hist)
        if self.turn_close is None:
            return "template_unprobed"
        if not k or len(msgs) < k:
            return "history_edited"
        if not _same_json(tools, self._tools):
            return "tools_changed"
        # fast path: the previous request echoed verbatim leaves only the returned reply to check
        prev = self._last_req[0] if self._last_req is not None else None
        fast = prev is not None and len(prev) == k - 1 and _same_messages(msgs[: k - 1], prev)
        for i in range(k - 1 if fast else 0, k):
            if not self._echoes(i, msgs[i]):
                return "reply_edited" if hist[i]["role"] == "assistant" else "history_edited"
        # render the committed history (what the model produced, e.g. an unechoed think block)
        win = self._window_check(hist, msgs[k:], tools) if self.window_proof is not None else None
        if win is not None:
            held_new, after = win
            held = self._last_prompt_text + held_new
            full = held + after
            self.render_stats["window"] += 1
        else:
            full = self.render(hist + msgs[k:], tools)
            held = self.render(hist, tools, add_generation_prompt=False)
            self.render_stats["full"] += 1
            if not (full.startswith(held) and held.startswith(self._last_prompt_text) and held.endswith(self.turn_close)):
                return "template_rewrites_history"
        close = self.turn_close
        o = self._open
        if o.finish_reason == "stop" and o.token_ids and o.loss_mask[-1] and self._last_stop_token:
            last = self.tokenizer.decode([o.token_ids[-1]], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last):]
        tail = close + full[len(held):]
        self._check_fits_text(len(o.token_ids), tail, max_prompt_tokens)
        return full, self._encode(tail)

    def _window_check(self, hist: list[dict[str, Any]], new: list[dict[str, Any]],
                      tools: Any) -> tuple[str, str] | None:
        """The extend check on a window ``hist[:head] + hist[j:]``: ``(held[len(previous prompt):],
        new prompt[len(held):])`` as the full renders give them, or None (the caller renders in full)."""
        proof = self.window_proof
        assert proof is not None and self._compiled is not None and self.turn_close is not None
        head, close = hist[: proof.head], self.turn_close
        try:
            last_prev, last_full = self._scan_lasts(hist, new)
            j = window_start(proof, len(hist) - 1, last_prev, last_full)
            if j is None:
                return None
            prev = self._render_window(head + hist[j:-1], tools, True)
            held = self._render_window(head + hist[j:], tools, False)
            full = self._render_window(head + hist[j:] + new, tools, True)
        except Exception:  # noqa: BLE001 - NegativeIndex, a template error: the full render decides (and raises)
            return None
        if not (full.startswith(held) and held.startswith(prev) and len(held) - len(prev) >= len(close)
                and held.endswith(close)):
            return None
        return held[len(prev):], full[len(held):]

    def _scan_lasts(self, hist: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Per scan, the last index satisfying it in ``hist[:-1]`` and in ``hist + new`` (-1: none)."""
        proof = self.window_proof
        assert proof is not None
        if self._scan_n > len(hist):  # pragma: no cover - the cache follows the history
            self._scan_hits, self._scan_n = [[] for _ in proof.scans], 0
        found: list[list[int]] = [[] for _ in proof.scans]
        for i in range(self._scan_n, len(hist)):
            m = _chat_form(hist[i])
            for hits, scan in zip(found, proof.scans):
                if scan.pred(m):
                    hits.append(i)
        for hits, more in zip(self._scan_hits, found):  # only once every predicate ran (one may raise)
            hits += more
        self._scan_n = len(hist)
        n_prev = len(hist) - 1
        last_prev, last_full = [], []
        for hits, scan in zip(self._scan_hits, proof.scans):
            lp = hits[-1] if hits and hits[-1] < n_prev else (hits[-2] if len(hits) > 1 else -1)
            lf = hits[-1] if hits else -1
            for i in range(len(new) - 1, -1, -1):
                if scan.pred(_chat_form(new[i])):
                    lf = len(hist) + i
                    break
            last_prev.append(lp)
            last_full.append(lf)
        return last_prev, last_full
