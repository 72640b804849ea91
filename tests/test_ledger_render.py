"""The ledger's window-checked extend (molt_core/ledger/render.py) against the full render.

Exactness: for every shipped or test template, over random conversations (hypothesis), the
window ledger plans exactly what the full-render ledger plans (mode, prompt ids, tail, text,
re-encoded count) -- history rewrites included. The proof refuses each construct that would
break it (one template per construct), and a deliberately wrong proof is caught by the same
comparison (the property test can fail). The message prefix cache (ledger_messages.py)
returns exactly ``normalize_messages``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_core.assets.build_tiny_tokenizer import CHAT_TEMPLATE
from molt_core.ledger import Ledger
from molt_core.ledger.messages import NormalizeCache, normalize_messages
from molt_core.ledger.render import Scan, WindowProof, window_start
from molt_core.models import load_tokenizer
from molt_core.testing import ScriptedEngine
from molt_core.types import SamplingParams
from molt_plugins.render_window import prove_window

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two ints",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]

CHATML = ("{%- for m in messages -%}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# the last message is marked: every held assistant turn changes once anything follows (a rewrite each turn)
LAST_MARK = CHATML.replace("~ m.content ~", "~ m.content ~ ('[last]' if loop.last else '') ~")
# an assistant turn followed by a tool result is re-rendered (a rewrite on tool turns only; radius 1)
NEXT_TOOL = CHATML.replace("~ m.content ~", "~ m.content ~ ('[+tool]' if not loop.last and "
                                            "messages[loop.index0 + 1].role == 'tool' else '') ~")
# radius 2 both ways: a message two back with the same role is noted, and a tool result two ahead
# (a rewrite when a tool result follows a tool-calling assistant turn)
RADIUS2 = CHATML.replace("~ m.content ~", "~ m.content ~ ('[=2]' if loop.index0 >= 2 and messages[loop.index0 - 2].role "
                                          "== m.role else '') ~ ('[+2 tool]' if messages[loop.index0 + 2] is defined and "
                                          "messages[loop.index0 + 2].role == 'tool' else '') ~")
# the Qwen3 idiom: a reversed scan for the last real user query (a user turn that is not a wrapped tool
# result) behind a found-flag, starting from the last index, an error when there is none; think blocks
# (reasoning_content) rendered only after that query; tool results merged into one user turn
REV_SCAN = (
    "{%- set ns = namespace(searching=true, last_q=messages | length - 1) -%}"
    "{%- for m in messages[::-1] -%}{%- set idx = (messages | length - 1) - loop.index0 -%}"
    "{%- if ns.searching and m.role == 'user' and not m.content.startswith('<tool_response>') -%}"
    "{%- set ns.searching = false -%}{%- set ns.last_q = idx -%}{%- endif -%}{%- endfor -%}"
    "{%- if ns.searching -%}{{- raise_exception('no user query') -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_q and m.reasoning_content is string -%}"
    "{{- '<think>\\n' ~ m.reasoning_content ~ '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- m.content ~ '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# the turn count in the system prompt: outside the proven class; no turn is ever an extension
TURN_COUNT = "{{- '<|im_start|>system\\nturn ' ~ (messages | length) ~ '<|im_end|>\\n' -}}" + CHATML
# a mark once the conversation holds more than 5 user turns: outside the proven class, and a window
# (which sees a few user turns) would never show it -- the history rewrite a wrong proof would miss
USER_GATE = ("{{- '[long]' if (messages | selectattr('role', 'equalto', 'user') | list | length) > 5 else '' -}}"
             + CHATML)
# an unguarded left neighbour: at index 0 it reads messages[-1], the last message (the window refuses the
# negative index); a prompt ending on a tool result marks the first message, a history rewrite
UNGUARDED = CHATML.replace("~ m.content ~", "~ m.content ~ ('[after tool]' if messages[loop.index0 - 1].role == 'tool' "
                                            "else '') ~")


@pytest.fixture(scope="module")
def toks() -> dict[str, Any]:
    out = {}
    for name, tmpl in (("shipped", None), ("chatml", CHATML), ("last_mark", LAST_MARK), ("next_tool", NEXT_TOOL),
                       ("radius2", RADIUS2), ("turn_count", TURN_COUNT), ("unguarded", UNGUARDED),
                       ("user_gate", USER_GATE), ("rev_scan", REV_SCAN)):
        tok = load_tokenizer("builtin:tiny-qwen3")
        if tmpl is not None:
            tok.chat_template = tmpl
        out[name] = tok
    return out


def _env():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(CHATML).environment


def proof_of(source: str) -> tuple[WindowProof | None, str]:
    return prove_window(source, _env())


# ------------------------------------------------------------------------------- the proof


def test_shipped_template_is_proven_with_one_last_user_scan():
    proof, why = proof_of(CHAT_TEMPLATE)
    assert why == "" and proof is not None
    assert (proof.radius, proof.head, len(proof.scans)) == (1, 1, 1)
    scan = proof.scans[0].pred
    assert proof.scans[0].reverse is False and [scan({"role": r, "content": "x"}) for r in ("user", "assistant", "tool", "system")] == [True, False, False, False]


def test_reverse_scan_idiom_is_proven():
    proof, why = proof_of(REV_SCAN)
    assert why == "" and proof is not None and (proof.radius, proof.head, len(proof.scans)) == (1, 1, 1)
    scan = proof.scans[0]
    assert scan.reverse is True
    assert [scan.pred({"role": r, "content": c}) for r, c in (("user", "q"), ("user", "<tool_response>x"),
                                                                  ("assistant", "q"))] == [True, False, False]


@pytest.mark.parametrize("source, radius, head", [(CHATML, 0, 1), (NEXT_TOOL, 1, 1), (RADIUS2, 2, 3), (LAST_MARK, 0, 1)])
def test_local_templates_are_proven_with_their_radius(source, radius, head):
    proof, why = proof_of(source)
    assert why == "" and proof is not None and (proof.radius, proof.head, proof.scans) == (radius, head, [])


LOOP = "{%- for m in messages -%}{{- m.content -}}{%- endfor -%}"


@pytest.mark.parametrize("source, reason", [
    (TURN_COUNT, "kind 'len' used as a value"),
    (USER_GATE, "the filter 'selectattr' on a msgs"),
    ("{{- messages[-1].content -}}" + LOOP, "messages subscripted"),
    ("{{- messages[1:] | length -}}", "messages subscripted"),
    (LOOP.replace("m.content", "m.content ~ loop.length"), "loop.length"),
    (LOOP.replace("m.content", "m.content ~ loop.revindex"), "loop.revindex"),
    (LOOP.replace("m.content", "(m.content if loop.index0 % 2 else '')"), "kind 'idx' used as a value"),
    (LOOP.replace("m.content", "loop.index"), "kind 'idx' used as a value"),
    ("{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- set ns.n = ns.n + 1 -%}{{- ns.n -}}{%- endfor -%}",
     "namespace attribute assigned inside a messages loop"),
    ("{{- strftime_now('%d %b %Y') -}}" + LOOP, "strftime_now"),
    (LOOP.replace("m.content", "(m.content if add_generation_prompt else '')"), "add_generation_prompt"),
    ("{%- if add_generation_prompt -%}x{%- endif -%}" + LOOP, "add_generation_prompt"),
    (LOOP + LOOP, "two messages loops write output"),
    (LOOP.replace("m.content", "raise_exception('no')"), "raise_exception"),
    ("{%- set ns = namespace(u=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.u = loop.index0 -%}"
     "{%- endif -%}{%- endfor -%}{{- 'x' if ns.u > 0 else 'y' -}}" + LOOP, "scanned index compared"),
    ("{%- set ns = namespace(u=messages | length) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
     "{%- set ns.u = loop.index0 -%}{%- endif -%}{%- endfor -%}" + LOOP, "kind 'len' used as a value"),
    ("{%- set ns = namespace(u=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' and loop.last -%}"
     "{%- set ns.u = loop.index0 -%}{%- endif -%}{%- endfor -%}" + LOOP, "scan predicate reading ['loop']"),
    ("{%- set ns = namespace(u=-1) -%}{%- macro f() -%}{{- ns.u -}}{%- endmacro -%}" + LOOP, "read inside a macro"),
    ("{%- for m in messages if m.role != 'system' -%}{{- m.content -}}{%- endfor -%}", "a filter"),
    (LOOP.replace("{{- m.content -}}", "{%- if m.content -%}{%- break -%}{%- endif -%}"), "Break"),
    (LOOP.replace("m.content", "loop.previtem"), "loop.previtem"),
    ("{%- set xs = messages -%}" + LOOP, "kind 'msgs' used as a value"),
    (REV_SCAN.replace("ns.searching and m.role", "ns.searching and loop.last and m.role"), "scan predicate reading"),
    (REV_SCAN.replace("{%- set ns.searching = false -%}", ""), "a reversed messages loop other than"),
    (REV_SCAN.replace("(messages | length - 1) - loop.index0", "loop.index0"), "a reversed messages loop other than"),
    (REV_SCAN.replace("loop.index0 > ns.last_q", "ns.last_q > 0"), "scanned index compared"),
    ("{%- set ns = namespace(q=messages | length - 1) -%}{{- ns.q -}}" + LOOP, "kind 'pending' used as a value"),
    ("{%- set text -%}" + LOOP + "{%- endset -%}{{- text | length -}}", "inside a loop, a macro or a {% set %} block"),
    ("{%- for t in tools -%}" + LOOP + "{%- endfor -%}", "inside a loop, a macro or a {% set %} block"),
    ("{%- set ns = namespace(u=-1) -%}{%- set ns.u = 3 -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
     "{%- set ns.u = loop.index0 -%}{%- endif -%}{%- endfor -%}" + LOOP, "starts from a value other than a constant <= 0"),
    ("{%- for m in messages | reverse -%}{{- m.content -}}{%- endfor -%}", "the filter 'reverse' on a msgs"),
])
def test_constructs_outside_the_class_are_refused(source, reason):
    proof, why = proof_of(source)
    assert proof is None and reason in why, why


def test_window_start_conditions():
    """Radius 1, head 1, previous prompt of 20 messages: the window starts at 20 - 2 = 18
    unless a scanned index sits in the boundary (then it moves to before it) or changes."""
    p = WindowProof(radius=1, head=1)
    assert window_start(p, 20, [], []) == 18
    p.scans = [Scan(lambda m: True)]
    assert window_start(p, 20, [19], [21]) == 18  # last user past the boundary: A
    assert window_start(p, 20, [5], [5]) == 18  # unchanged and before the gap: B
    assert window_start(p, 20, [18], [21]) == 17  # in the boundary: moved so 18 >= j + 1
    assert window_start(p, 20, [5], [21]) == 4  # changes from before the gap: the gap ends before it
    assert window_start(p, 20, [1], [21]) is None  # no window shorter than the conversation
    p.scans = [Scan(lambda m: True, reverse=True)]
    assert window_start(p, 20, [19], [21]) == 18
    assert window_start(p, 20, [-1], [-1]) == 18  # no query anywhere: the last index, in every render
    assert window_start(p, 20, [5], [5]) == 4  # a query in the gap: its flag would differ, so it joins the window
    assert window_start(p, 20, [-1], [21]) is None  # the flag flips between the renders
    assert window_start(WindowProof(radius=0, head=1), 3, [], []) == 2
    assert window_start(WindowProof(radius=0, head=1), 2, [], []) is None


# ------------------------------------------------------------------------------- exactness

REPLIES = {"plain": "Sure, {i}.", "think": "<think>\nplan {i}\n</think>\n\nDone {i}.",
           "call": 'Calling.\n<tool_call>\n{{"name": "add", "arguments": {{"a": {i}}}}}\n</tool_call>'}
# mostly extensions (user and tool turns), with every kind of rewrite now and then
actions = st.lists(st.tuples(st.sampled_from(["plain", "plain", "call", "think"]),
                             st.sampled_from(["user"] * 4 + ["tool"] * 3 + ["tools2", "edit", "compact", "retry", "system"]),
                             st.booleans()),
                   min_size=4, max_size=16)


def play(tok: Any, window: bool, script: list[tuple[str, str, bool]], tools: Any = TOOLS,
         kwargs: dict[str, Any] | None = None) -> tuple[list[tuple[Any, ...]], Ledger]:
    """Run one session; per request the plan (mode, prompt ids, tail ids, text, re-encoded)."""
    led = Ledger(tok, window_prover=prove_window if window else None, chat_template_kwargs=kwargs)
    eng = ScriptedEngine(tok)
    # the client starts from an earlier conversation (so windows apply from the second request)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0"},
                                  {"role": "assistant", "content": "a0"}, {"role": "user", "content": "u1"},
                                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "start"}]
    plans = []
    for i, (reply, nxt, echo_think) in enumerate(script):
        p = led.prepare(msgs, tools, SamplingParams())
        plans.append((p.mode, p.prompt_ids, p.tail_ids, p.prompt_text, p.reencoded))
        turn = led.commit(p, eng.output(REPLIES[reply].format(i=i), SamplingParams(), 0) if p.mode != "retry" else None)
        if nxt == "retry":
            continue
        am: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if echo_think and turn.reasoning:
            am["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            am["tool_calls"] = [{"id": c["id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}} for c in turn.tool_calls]
        msgs = msgs + [am]
        if nxt == "tool" or (turn.tool_calls and nxt == "user"):
            msgs.append({"role": "tool", "content": f"result {i}"})
        elif nxt == "tools2":
            msgs += [{"role": "tool", "content": f"r{i}a"}, {"role": "tool", "content": f"r{i}b"}]
        elif nxt == "edit":  # an earlier user message edited
            k = max(j for j, m in enumerate(msgs) if m["role"] == "user")
            msgs[k] = {**msgs[k], "content": msgs[k]["content"] + " (edited)"}
            msgs.append({"role": "user", "content": f"after edit {i}"})
        elif nxt == "compact":  # context compaction
            msgs = [{"role": "user", "content": f"summary up to {i}"}] + msgs[-2:] + [{"role": "user", "content": f"q{i}"}]
        elif nxt == "system":
            msgs = [{"role": "system", "content": f"be brief {i}"}] + [m for m in msgs if m["role"] != "system"]
            msgs.append({"role": "user", "content": f"q{i}"})
        else:
            msgs.append({"role": "user", "content": f"question {i}"})
    return plans, led


def same_as_full(tok: Any, script: list[tuple[str, str, bool]], **kw: Any) -> Ledger:
    got, led_w = play(tok, True, script, **kw)
    want, led_f = play(tok, False, script, **kw)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i}: window plan {g[0]!r} vs full render {w[0]!r}"
    assert led_w.trajectory().segments == led_f.trajectory().segments
    assert led_f.render_stats["window"] == 0
    return led_w


TEMPLATES = ["shipped", "chatml", "last_mark", "next_tool", "radius2", "turn_count", "unguarded", "user_gate", "rev_scan"]


@pytest.mark.parametrize("name", TEMPLATES)
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=actions)
def test_window_plans_equal_full_render_plans(toks, name, script):
    same_as_full(toks[name], script)


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=actions)
def test_window_plans_equal_full_render_plans_many(toks, name, script):
    same_as_full(toks[name], script)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=actions)
def test_window_plans_equal_full_render_plans_without_tools_or_thinking(toks, script):
    same_as_full(toks["shipped"], script, tools=None, kwargs={"enable_thinking": False})


def long_chat(n: int, reply: str = "plain", nxt: str = "user") -> list[tuple[str, str, bool]]:
    return [(reply, nxt, False)] * n


def test_long_sessions_take_the_window_and_stay_exact(toks):
    """30 plain turns: every extend check is a window. The shipped template (head 1, radius 1)
    needs a previous prompt of more than head + 2 * radius = 3 messages; the session starts
    from 6 (the client's earlier conversation). The window starts at 6 - 2 = 4, and the last
    user message (5) is past the boundary (4 + 1)."""
    led = same_as_full(toks["shipped"], long_chat(30))
    assert led.counts == {"start": 1, "extend": 29, "rewrite": 0, "retry": 0}
    assert led.render_stats == {"window": 29, "full": 0}
    led = same_as_full(toks["shipped"], long_chat(30, "call", "tool"))
    assert led.render_stats == {"window": 29, "full": 0} and led.counts["extend"] == 29
    # the reverse scan: a tool chain after the last user query keeps that query (index 5) in the
    # window, which starts at 5 - radius = 4 from then on (a window growing with the chain)
    for script in (long_chat(30), long_chat(30, "call", "tool")):
        led = same_as_full(toks["rev_scan"], script)
        assert led.render_stats == {"window": 29, "full": 0} and led.counts["extend"] == 29
    # the last-marker template rewrites every turn: the window sees it and the full render decides
    led = same_as_full(toks["last_mark"], long_chat(12))
    assert led.counts["rewrite"] == 11 and led.render_stats["window"] == 0
    # outside the class, and a window refused for its negative subscript: the full render each turn
    for name in ("user_gate", "unguarded"):
        led = same_as_full(toks[name], long_chat(8))
        assert led.render_stats == {"window": 0, "full": 7}, name
    assert same_as_full(toks["user_gate"], long_chat(8)).counts["rewrite"] == 1  # the 6th user turn adds [long]
    # the turn count changes the system prompt each turn: no probe close, every request a rewrite
    led = same_as_full(toks["turn_count"], long_chat(8))
    assert led.counts["rewrite"] == 7 and led.render_stats == {"window": 0, "full": 0}


def test_deep_think_stripping_rewrite_is_caught_through_the_window(toks):
    """B03 after 20 window-checked turns: a reply with a think block, then a new user turn --
    the template drops the block from history, so the ledger seals the segment."""
    script = long_chat(20) + [("think", "user", True), ("plain", "user", False)]
    led = same_as_full(toks["shipped"], script)
    assert led.counts == {"start": 1, "extend": 20, "rewrite": 1, "retry": 0}
    # request 22: the window does not extend, so the full render decides
    assert len(led.segments()) == 2 and led.render_stats == {"window": 20, "full": 1}
    # a tool result after the think reply keeps it (no user turn follows): still an extension
    led = same_as_full(toks["shipped"], long_chat(20) + [("think", "tool", True), ("plain", "user", False)])
    assert led.counts["rewrite"] == 0 and led.counts["extend"] == 21


def test_a_wrong_proof_is_caught_by_the_comparison(toks, monkeypatch):
    """Fault injection: force a window proof on the user-gate template (outside the class).
    The window then misses the rewrite at the 6th user turn, and the exactness check flags it."""
    tok = load_tokenizer("builtin:tiny-qwen3")
    tok.chat_template = USER_GATE + "{#- forced -#}"  # a template text of its own (fresh template facts)
    monkeypatch.setitem(globals(), "prove_window", lambda *a: (WindowProof(radius=0, head=1), ""))
    with pytest.raises(AssertionError, match="window plan 'extend' vs full render 'rewrite'"):
        same_as_full(tok, long_chat(8))


def test_negative_subscript_refuses_the_window(toks):
    """The unguarded template is proven (radius 1) but reads messages[-1] at index 0."""
    led = Ledger(toks["unguarded"], window_prover=prove_window)
    assert led.window_proof is not None and led.window_proof.radius == 1
    same_as_full(toks["unguarded"], long_chat(6))


# ------------------------------------------------------------------------------- prefix cache


def test_normalize_cache_equals_normalize_messages():
    cache = NormalizeCache()
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "2", "tool_call_id": "1"}]
    reqs = [base, base + [{"role": "user", "content": "c"}], base[:2] + [{"role": "user", "content": "d"}]]
    # arguments as objects: 1 == True and key order are invisible to == but not to the render
    obj = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1, "b": 2}}}]}]
    reqs += [obj, [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": True, "b": 2}}}]}],
             [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"b": 2, "a": 1}}}]}]]
    for r in reqs:
        got, want = cache(r), normalize_messages(r)
        assert got == want and [json.dumps(m) for m in got] == [json.dumps(m) for m in want]
    # an int id vs its string: not cached (== would differ anyway); a message edited in place is seen
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert cache(msgs)[1]["content"] == "y"
    msgs[1]["content"] = "z"
    assert cache(msgs)[1]["content"] == "z"


def test_normalize_cache_errors_name_the_request_index():
    cache = NormalizeCache()
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    cache(msgs)
    with pytest.raises(ValueError, match=r"messages\[2\]\.role must be one of"):
        cache(msgs + [{"role": "robot", "content": "z"}])
    with pytest.raises(ValueError, match="messages must be a list"):
        cache({"role": "user"})
    assert cache(msgs) == normalize_messages(msgs)


def test_prepare_reuses_the_normalized_prefix(toks):
    """A client re-sending its history: the ledger's history messages are reused, not re-read."""
    tok = toks["shipped"]
    led, eng = Ledger(tok), ScriptedEngine(tok)
    msgs = [{"role": "user", "content": "a"}]
    p1 = led.prepare(msgs)
    t1 = led.commit(p1, eng.output("b", SamplingParams(), 0))
    msgs2 = [dict(m) for m in msgs] + [t1.message(), {"role": "user", "content": "c"}]
    p2 = led.prepare(msgs2)
    assert p2.mode == "extend" and p2.messages[0] is p1.messages[0]
    assert asyncio.run(eng.generate(p2.prompt_ids, SamplingParams())).finish_reason == "stop"
