"""Recording one generation (:meth:`Ledger.commit`, atomic) and parsing it into an
:class:`~molt_core.ledger.AssistantTurn`. Generated text is never re-encoded into action tokens."""

from __future__ import annotations

from molt_core.ledger.compare import _call_id, _calls
from molt_core.ledger.records import AssistantTurn, LedgerConflict, Prepared, _Open
from molt_core.types import GenerationOutput, SampledSpan, SamplingParams

__all__ = ["Recording"]


class Recording:
    """The recording half of :class:`~molt_core.ledger.Ledger` (a mixin over the session's state):
    :meth:`commit` and :meth:`parse`."""

    def commit(self, prepared: Prepared, output: GenerationOutput, params: SamplingParams | None = None) -> AssistantTurn:
        """Record one successful generation atomically and return it parsed.

        Appends ``prepared.tail_ids`` (``loss_mask`` False) and ``output.token_ids`` (True; logprobs,
        versions, a :class:`SampledSpan` of ``params``' transform and the engine's digest). A
        ``retry`` plan records nothing and returns the cached turn.

        Raises:
            LedgerConflict: another request was committed after ``prepared`` was made.
        """
        params = params or SamplingParams()
        with self._lock:
            if prepared.mode == "retry":
                self.counts["retry"] += 1
                assert prepared.cached is not None
                return prepared.cached
            if prepared.epoch != self._epoch:
                raise LedgerConflict("the session changed between prepare() and commit(); serialize its requests")
            # everything that can fail happens before the first mutation (atomic commit)
            turn = self.parse(prepared, output)
            replies = dict(self._replies) if prepared.mode == "extend" else {}
            replies[len(prepared.messages)] = (turn.content, turn.reasoning, _calls(turn.message()))
            sealed = self._open.segment() if prepared.mode == "rewrite" else None
            o = _Open() if sealed is not None else self._open
            n0 = len(o.token_ids)
            start = n0 + len(prepared.tail_ids)
            n = len(output.token_ids)
            lps, vs = [float(x) for x in output.logprobs], [int(v) for v in output.versions]
            span = SampledSpan(start=start, end=start + n, temperature=params.temperature, top_p=params.top_p,
                               top_k=params.top_k, digest=output.sampled_digest,
                               sampled_ids=list(output.token_ids) if output.sampled_digest is not None else None) if n else None
            if sealed is not None:
                self._sealed.append(sealed)
                self._open = o
            o.images += prepared.image_refs
            o.token_ids += prepared.tail_ids
            o.loss_mask += [False] * len(prepared.tail_ids)
            o.logprobs += [None] * len(prepared.tail_ids)
            o.versions += [None] * len(prepared.tail_ids)
            o.token_ids += output.token_ids
            o.loss_mask += [True] * n
            o.logprobs += lps
            o.versions += vs
            if span is not None:
                o.spans.append(span)
            o.finish_reason = output.finish_reason
            self._routed(o, n0, output)
            self._last_stop_token = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
            self._history = prepared.messages + [turn.message()]
            self._replies = replies
            if prepared.mode != "extend":  # the scan cache covers a history this one no longer extends
                self._scan_hits, self._scan_n = [[] for _ in self._scan_hits], 0
            self._tools = prepared.tools
            self._last_prompt_text = prepared.prompt_text
            self._last_req, self._last_turn = prepared.key, turn
            self.counts[prepared.mode] += 1
            if prepared.mode == "rewrite" and prepared.cause is not None:
                self.rewrite_causes[prepared.cause] += 1
            self.context_reencoded_tokens += prepared.reencoded
            self.length_cut_turns += output.finish_reason == "length"
            self._epoch += 1
            return turn

    _last_stop_token = False

    @staticmethod
    def _routed(o: _Open, n0: int, output: GenerationOutput) -> None:
        # routed_experts covers this request's prompt + sampled positions: keep held rows, add new ones
        if output.routed_experts is None:
            if output.token_ids:
                o.routed_ok = False
            return
        if n0 == 0:
            o.routed = list(output.routed_experts)
        elif o.routed is not None:
            # a held -1 row (the last sampled token, which only this prefill ran) takes the new row
            new = output.routed_experts
            o.routed = [new[i] if i < len(new) and any(x < 0 for layer in row for x in layer) else row
                        for i, row in enumerate(o.routed)]
            o.routed += list(new[n0:])
        else:
            o.routed_ok = False

    def parse(self, prepared: Prepared, output: GenerationOutput) -> AssistantTurn:
        """Turn a generation into an :class:`AssistantTurn` (decoding only; ids stay exact).

        Drops the stop token or cuts at the stop string, splits the think block (one the generation
        prompt opened counts, B04) and extracts the tool calls after it with :attr:`tool_parser`
        (none when ``prepared.allow_tool_calls`` is False).
        """
        ids = list(output.token_ids)
        stop_seq = output.stop_reason if isinstance(output.stop_reason, str) else None
        if output.finish_reason == "stop" and ids and stop_seq is None and (
                output.stop_reason == ids[-1] or ids[-1] in self.stop_token_ids):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
        if stop_seq and stop_seq in text:
            text = text[: text.index(stop_seq)]
        prefix = self.body_prefix if prepared.prompt_text.endswith(self.body_prefix) else ""
        body = prefix + text
        calls, spans = [], []
        open_t, close_t = self.think
        visible_from = body.rfind(close_t) + len(close_t) if close_t in body else (len(body) if open_t in body else 0)
        found = self.tool_parser.parse(body, visible_from, prepared.tools) if prepared.allow_tool_calls else []
        for k, c in enumerate(found):
            calls.append({"id": _call_id(prepared.prompt_ids, ids, k), "name": c.name, "arguments": c.arguments})
            if not spans or spans[-1] != c.span:
                spans.append(c.span)
        raw = body
        for a, b in reversed(spans):
            raw = raw[:a] + raw[b:]
        raw = raw.rstrip() if spans else raw
        reasoning = None
        if close_t in raw:
            head, _, vis = raw.rpartition(close_t)
            reasoning = head.split(open_t)[-1].strip("\n")
        elif open_t in raw:
            reasoning, vis = raw.split(open_t, 1)[1].strip("\n"), ""
        else:
            vis = raw
        finish = output.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        return AssistantTurn(content=vis.strip(), reasoning=reasoning or None, tool_calls=calls, raw=raw,
                             finish_reason=finish, stop_sequence=stop_seq, token_ids=list(output.token_ids),
                             logprobs=list(output.logprobs), prompt_len=len(prepared.prompt_ids))
