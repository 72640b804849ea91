"""Token identity at the ledger: cases B01-B04, B06/B07 of issue 3, tool round trips,
compaction, retries, failed requests; the engine's record of sampled ids carried into each
span (checked at trainer ingress), context re-encoded on a rewrite, length-cut turns."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from fake_engine import ScriptedEngine
from molt_core.assets.build_tiny_tokenizer import CHAT_TEMPLATE
from molt_core.engines.base import GenerationOutput
from molt_core.identity import TokenCheck, check_tokens, digest_ids, screen
from molt_core.ledger import REWRITE_CAUSES, Ledger, LedgerConflict
from molt_core.models import load_tokenizer
from molt_core.types import SamplingParams

torch.set_num_threads(1)

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two ints",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def turn(led, eng, msgs, tools=None, params=None):
    params = params or SamplingParams()
    p = led.prepare(msgs, tools, params)
    out = asyncio.run(eng.generate(p.prompt_ids, params))
    return p, led.commit(p, out, params)


def ab_tokenizer():
    """A byte-level BPE where "a" = 1, "b" = 2 and the merge "ab" = 3 (case B02)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in ("a", "b")]
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}
    for c in sorted(alphabet):
        vocab[c] = len(vocab)
    vocab["<|im_start|>"], vocab["<|im_end|>"] = len(vocab), len(vocab) + 1
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)


def test_b02_sampled_ids_are_never_reencoded():
    tok = ab_tokenizer()
    assert tok.encode(tok.decode([1, 2]), add_special_tokens=False) == [3]  # the premise of B02
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "x"}]
    p1 = led.prepare(msgs)
    out = GenerationOutput(token_ids=[1, 2], logprobs=[-0.5, -0.25], versions=[7, 7], finish_reason="length",
                           sampled_digest=digest_ids([1, 2]))
    t1 = led.commit(p1, out, SamplingParams(max_tokens=2))
    (seg,) = led.segments()
    n = len(p1.prompt_ids)
    assert seg.token_ids == p1.prompt_ids + [1, 2]
    assert seg.loss_mask[n:] == [True, True] and seg.loss_mask[:n] == [False] * n
    assert seg.logprobs[n:] == [-0.5, -0.25] and seg.versions[n:] == [7, 7]
    assert t1.content == "ab"
    p2 = led.prepare(msgs + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "y"}])
    assert p2.mode == "extend"
    assert p2.prompt_ids[: n + 2] == p1.prompt_ids + [1, 2]
    # the generation stopped by length: the template's whole close "<|im_end|>\n" follows
    assert p2.tail_ids == tok.encode("<|im_end|>\n<|im_start|>user\ny<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    # the engine's record came with the span; the trainer's check finds the sampled [1, 2]
    assert seg.spans[0].sampled_ids == [1, 2] and seg.spans[0].digest == digest_ids([1, 2])
    assert check_tokens(led.trajectory()) == TokenCheck(0, 0)


def test_b01_separator_once_and_stitched_equals_render(tok):
    led, eng = Ledger(tok), ScriptedEngine(tok, ["Hello there", "Fine"])
    im_start, im_end, nl = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>"), enc(tok, "\n")
    assert len(nl) == 1
    msgs = [{"role": "user", "content": "hi"}]
    p1, t1 = turn(led, eng, msgs)
    msgs += [{"role": "assistant", "content": t1.content}, {"role": "user", "content": "more"}]
    p2, _ = turn(led, eng, msgs)
    assert p2.mode == "extend"
    s1 = enc(tok, "Hello there") + [im_end]
    assert p2.prompt_ids == p1.prompt_ids + s1 + enc(tok, "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    # the separator between <|im_end|> and the next <|im_start|> is there exactly once
    ids = p2.prompt_ids
    pairs = [i for i in range(len(ids) - 2) if ids[i] == im_end and ids[i + 2] == im_start]
    assert len(pairs) == ids.count(im_end) == 3 and all(ids[i + 1] == nl[0] for i in pairs)
    assert [ids[i + 1] for i in range(len(ids) - 1) if ids[i] == im_end] == nl * 3
    # equals the full render (tokenized) except for the sampled span, which is exact
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.decode(ids) == full
    assert enc(tok, full) == ids  # here the sampled span happens to match its re-encoding too


def test_b03_think_stripping_seals_segment(tok):
    led = Ledger(tok)
    eng = ScriptedEngine(tok, ["<think>\nplan it\n</think>\n\nFour.", "<think>\nagain\n</think>\n\nFive."])
    think, unthink = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    msgs = [{"role": "user", "content": "2+2?"}]
    p1, t1 = turn(led, eng, msgs)
    assert (t1.content, t1.reasoning) == ("Four.", "plan it")
    msgs += [{"role": "assistant", "content": t1.content, "reasoning_content": t1.reasoning}, {"role": "user", "content": "2+3?"}]
    p2, _ = turn(led, eng, msgs)
    assert p2.mode == "rewrite"
    seg1, seg2 = led.segments()
    # segment 1 keeps the think tokens the model sampled in it, as sampled tokens
    n1 = len(p1.prompt_ids)
    assert seg1.token_ids[:n1] == p1.prompt_ids
    assert seg1.token_ids[n1] == think and seg1.loss_mask[n1] and unthink in seg1.token_ids[n1:]
    # segment 2 starts from the re-rendered prompt: turn 1's think block is gone there...
    assert seg2.token_ids[: len(p2.prompt_ids)] == enc(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert think not in seg2.token_ids[: len(p2.prompt_ids)]
    # ...and the think tokens sampled within segment 2 are in it
    assert seg2.token_ids[len(p2.prompt_ids)] == think and all(seg2.loss_mask[len(p2.prompt_ids):])
    traj = led.trajectory(reward=1.0)
    assert [len(s) for s in traj.segments] == [len(seg1), len(seg2)] and traj.reward == 1.0
    assert traj.info["requests"] == {"start": 1, "extend": 0, "rewrite": 1, "retry": 0}


def test_b04_generation_prompt_opens_think(tok):
    tok2 = load_tokenizer("builtin:tiny-qwen3")
    gen = "'<|im_start|>assistant\\n'"
    i = CHAT_TEMPLATE.rfind(gen)
    tok2.chat_template = CHAT_TEMPLATE[:i] + "'<|im_start|>assistant\\n<think>\\n'" + CHAT_TEMPLATE[i + len(gen):]
    led = Ledger(tok2)
    assert led.body_prefix == "<think>\n"
    think, unthink, im_end = (tok2.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<|im_end|>"))
    completion = [unthink] + enc(tok2, "\n\nSeven.") + [im_end]
    eng = ScriptedEngine(tok2, [completion, "</think>\n\nEight."])
    msgs = [{"role": "user", "content": "3+4?"}]
    p1, t1 = turn(led, eng, msgs)
    assert p1.prompt_ids[-2:] == [think] + enc(tok2, "\n")
    (seg,) = led.segments()
    assert seg.token_ids == p1.prompt_ids + completion
    assert seg.token_ids.count(think) == 1 and seg.token_ids.count(unthink) == 1
    assert (t1.content, t1.reasoning, t1.raw) == ("Seven.", None, "<think>\n</think>\n\nSeven.")
    # a tool-less follow-up without a new user turn keeps extending: one think per turn
    p2, _ = turn(led, eng, msgs + [{"role": "assistant", "content": "Seven."}, {"role": "tool", "content": "ok"}])
    assert p2.mode == "extend"
    (seg,) = led.segments()
    assert seg.token_ids.count(think) == 2 and seg.token_ids.count(unthink) == 2


def test_b06_b07_mask_from_reported_length(tok):
    S = tok.convert_tokens_to_ids("<|im_end|>")
    row = [101, 102, 103, S, S, S]  # an engine's padded batch row (pad id == stop id)
    reported = 4  # the engine's reported length: the first S is the real stop
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "go"}]
    p1 = led.prepare(msgs)
    led.commit(p1, GenerationOutput(token_ids=row[:reported], logprobs=[-1.0] * 4, versions=[0] * 4, finish_reason="stop",
                                    stop_reason=S))
    p2 = led.prepare(msgs + [{"role": "assistant", "content": tok.decode([101, 102, 103])}, {"role": "user", "content": "on"}])
    led.commit(p2, GenerationOutput(token_ids=[S], logprobs=[-0.5], versions=[0], finish_reason="stop", stop_reason=S))
    (seg,) = led.segments()
    n = len(p1.prompt_ids)
    assert seg.token_ids[n:n + 4] == [101, 102, 103, S]
    assert [int(m) for m in seg.loss_mask[n:n + 6]] == [1, 1, 1, 1, 0, 0]
    # S occurs as a prompt/template token too; only the sampled occurrences are masked in
    assert [seg.loss_mask[i] for i, t in enumerate(seg.token_ids) if t == S] == [False, True, False, True]
    # a pad/eos-like id sampled mid-sequence (not a stop for this request) stays sampled
    pad = tok.pad_token_id
    led2 = Ledger(tok)
    q = led2.prepare(msgs)
    led2.commit(q, GenerationOutput(token_ids=[101, pad, 103, S], logprobs=[-1.0] * 4, versions=[0] * 4, finish_reason="stop",
                                    stop_reason=S))
    assert led2.segments()[0].loss_mask[-4:] == [True] * 4


def test_tool_round_trip_several_results_one_turn(tok):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    eng = ScriptedEngine(tok, [f"Two calls.\n{call}\n{call}", "Both done."])
    led = Ledger(tok)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "add"}]
    p1, t1 = turn(led, eng, msgs, TOOLS)
    assert t1.finish_reason == "tool_calls" and t1.content == "Two calls."
    assert [(c["name"], c["arguments"]) for c in t1.tool_calls] == [("add", {"a": 1})] * 2
    # the client echoes arguments re-serialized without spaces: still the same message
    echo = {"role": "assistant", "content": "Two calls.", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": "add", "arguments": json.dumps(c["arguments"], separators=(",", ":"))}}
        for c in t1.tool_calls]}
    msgs += [echo, {"role": "tool", "tool_call_id": "1", "content": "r1"}, {"role": "tool", "tool_call_id": "2", "content": "r2"}]
    p2, t2 = turn(led, eng, msgs, TOOLS)
    assert p2.mode == "extend"
    assert p2.tail_ids == enc(tok, "\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
                                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    (seg,) = led.segments()
    s1 = eng.output(f"Two calls.\n{call}\n{call}", SamplingParams(), 0).token_ids
    s2 = eng.output("Both done.", SamplingParams(), 0).token_ids
    assert seg.token_ids == p1.prompt_ids + s1 + p2.tail_ids + s2
    assert seg.loss_mask == [False] * len(p1.prompt_ids) + [True] * len(s1) + [False] * len(p2.tail_ids) + [True] * len(s2)
    assert [(sp.start, sp.end) for sp in seg.spans] == [(len(p1.prompt_ids), len(p1.prompt_ids) + len(s1)),
                                                        (len(p2.prompt_ids), len(seg))]
    assert [sp.sampled_ids for sp in seg.spans] == [s1, s2]
    assert check_tokens(led.trajectory()) == TokenCheck(0, 0)  # every action token is the engine's


def test_tool_call_ids_are_a_function_of_the_tokens():
    """Issue 24 item 5 (every source of randomness): a tool call's id was ``uuid4`` -- a
    template that renders ids (Mistral's ``call_id``; here the tiny template made to print
    ``tool_call_id`` in each tool response) put random tokens in the next prompt, so two runs
    of the same episode, and a resumed run, trained on other tokens. Now call ``k`` of a turn
    is ``"call_"`` + SHA-256 of the turn's prompt ids, sampled ids (stop token dropped) and
    ``k``: two independent ledgers give the same ids and the same segment."""
    import hashlib

    t = load_tokenizer("builtin:tiny-qwen3")
    plain = "{{- '<tool_response>\\n' ~ text_of(m.content)"
    assert plain in t.chat_template
    t.chat_template = t.chat_template.replace(plain, "{{- '<tool_response>\\n' ~ m.tool_call_id ~ ': ' ~ text_of(m.content)")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'

    def episode():
        eng = ScriptedEngine(t, [f"Two calls.\n{call}\n{call}", "Both done."])
        led = Ledger(t)
        msgs = [{"role": "user", "content": "add"}]
        p1, t1 = turn(led, eng, msgs, TOOLS)
        echo = {"role": "assistant", "content": t1.content, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in t1.tool_calls]}
        msgs += [echo] + [{"role": "tool", "tool_call_id": c["id"], "content": f"r{k}"} for k, c in enumerate(t1.tool_calls)]
        p2, _ = turn(led, eng, msgs, TOOLS)
        s1 = eng.output(f"Two calls.\n{call}\n{call}", SamplingParams(), 0).token_ids
        return p1, [c["id"] for c in t1.tool_calls], p2, led.segments()[0].token_ids, s1, led.stop_token_ids

    p1, ids, p2, seg, s1, stops = episode()
    assert s1[-1] in stops  # the stop token is not part of the hashed reply
    key = lambda k: f"{','.join(map(str, p1.prompt_ids))}|{','.join(map(str, s1[:-1]))}|{k}"  # noqa: E731
    assert ids == ["call_" + hashlib.sha256(key(k).encode()).hexdigest()[:24] for k in (0, 1)]
    assert ids[0] != ids[1]
    assert p2.mode == "extend" and p2.tail_ids == enc(
        t, f"\n<|im_start|>user\n<tool_response>\n{ids[0]}: r0\n</tool_response>\n<tool_response>\n{ids[1]}: r1\n"
           "</tool_response><|im_end|>\n<|im_start|>assistant\n")  # the ids are in the trained context
    _, ids_again, _, seg_again, _, _ = episode()
    assert ids_again == ids and seg_again == seg


def test_edited_history_and_compaction_rewrite(tok):
    eng = ScriptedEngine(tok, ["One.", "Two.", "Three."])
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "a"}]
    turn(led, eng, msgs)
    edited = msgs + [{"role": "assistant", "content": "Uno."}, {"role": "user", "content": "b"}]
    p2, _ = turn(led, eng, edited)
    assert p2.mode == "rewrite"
    # the held user turn "a" is re-encoded as context of the new segment: <|im_start|> user \n a
    # <|im_end|> \n = 6 tokens (the edited assistant turn is new text, not held history)
    assert p2.reencoded == 6 == len(enc(tok, "<|im_start|>user\na<|im_end|>\n"))
    compact = [{"role": "system", "content": "summary: a, b"}, {"role": "user", "content": "c"}]
    p3, _ = turn(led, eng, compact)
    assert p3.mode == "rewrite" and len(led.segments()) == 3
    assert p3.reencoded == 0  # compaction: no earlier message is re-rendered
    traj = led.trajectory(reward=0.5)
    assert traj.info["context_reencoded_tokens"] == 6 and traj.info["requests"]["rewrite"] == 2
    assert {s.num_sampled for s in traj.segments} == {len(enc(tok, "Two.")) + 1, len(enc(tok, "One.")) + 1}
    assert traj.segments[2].token_ids[: len(p3.prompt_ids)] == enc(tok, tok.apply_chat_template(compact, add_generation_prompt=True, tokenize=False))


def test_retry_is_not_recorded_twice_and_failures_append_nothing(tok):
    eng = ScriptedEngine(tok, ["Once.", "Twice."])
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "a"}]
    _, t1 = turn(led, eng, msgs)
    before = led.segments()
    p = led.prepare(msgs, None, SamplingParams())
    assert p.mode == "retry" and led.commit(p, None) is t1
    assert led.segments() == before and eng.calls == 1
    # a different sampling setting is a new request (one more generation from the same prompt)
    assert led.prepare(msgs, None, SamplingParams(temperature=0.5)).mode == "rewrite"
    # a prepared request whose generation failed never commits: nothing changes
    led.prepare(msgs + [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "b"}])
    assert led.segments() == before
    # two plans on one state: the second commit is refused
    q1 = led.prepare(msgs + [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "b"}])
    q2 = led.prepare(msgs + [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "c"}])
    led.commit(q1, asyncio.run(eng.generate(q1.prompt_ids, SamplingParams())))
    with pytest.raises(LedgerConflict):
        led.commit(q2, asyncio.run(eng.generate(q2.prompt_ids, SamplingParams())))
    assert len(led.segments()) == 1


def test_stop_string_and_length_close(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "a"}]
    p1 = led.prepare(msgs)
    ids = enc(tok, "Answer: 5 END more")
    t = led.commit(p1, GenerationOutput(token_ids=ids, logprobs=[-1.0] * len(ids), versions=[3] * len(ids),
                                        finish_reason="stop", stop_reason="END"))
    assert t.content == "Answer: 5" and t.stop_sequence == "END"
    p2 = led.prepare(msgs + [{"role": "assistant", "content": "Answer: 5"}, {"role": "user", "content": "b"}])
    assert p2.mode == "extend" and p2.tail_ids[0] == im_end  # no stop token sampled: the close is whole
    assert p2.prompt_ids[: len(p1.prompt_ids) + len(ids)] == p1.prompt_ids + ids


def test_enable_thinking_false_body_prefix(tok):
    led = Ledger(tok, chat_template_kwargs={"enable_thinking": False})
    assert led.body_prefix == "<think>\n\n</think>\n\n"
    eng = ScriptedEngine(tok, ["Hi.", "Ok.", "Bye."])
    msgs = [{"role": "user", "content": "a"}]
    _, t1 = turn(led, eng, msgs)
    assert (t1.content, t1.reasoning) == ("Hi.", None)
    msgs += [{"role": "assistant", "content": "Hi."}, {"role": "tool", "content": "x"}]
    p2, _ = turn(led, eng, msgs)
    assert p2.mode == "extend"
    p3, _ = turn(led, eng, msgs + [{"role": "assistant", "content": "Ok."}, {"role": "user", "content": "b"}])
    assert p3.mode == "rewrite"  # the template drops the (empty) think blocks of earlier turns
    # the whole held history (4 messages) is re-encoded as context: 32 tokens of
    # "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\n<tool_response>\nx\n"
    # "</tool_response><|im_end|>\n<|im_start|>assistant\nOk.<|im_end|>\n"
    held = msgs + [{"role": "assistant", "content": "Ok."}]
    text = tok.apply_chat_template(held, add_generation_prompt=False, tokenize=False, enable_thinking=False)
    assert p3.reencoded == len(enc(tok, text)) == 32
    assert led.trajectory().info["context_reencoded_tokens"] == 32
    assert p3.cause == "template_rewrites_history" and led.rewrite_causes["template_rewrites_history"] == 1


def test_routed_experts_follow_tokens(tok):
    led = Ledger(tok)
    msgs = [{"role": "user", "content": "a"}]
    p1 = led.prepare(msgs)
    n1 = len(p1.prompt_ids) + 2
    led.commit(p1, GenerationOutput(token_ids=[101, 2], logprobs=[-1.0, -1.0], versions=[0, 0], finish_reason="stop",
                                    stop_reason=2, routed_experts=[[[1, 2]]] * n1))
    p2 = led.prepare(msgs + [{"role": "assistant", "content": tok.decode([101])}, {"role": "user", "content": "b"}])
    n2 = len(p2.prompt_ids) + 1
    led.commit(p2, GenerationOutput(token_ids=[2], logprobs=[-1.0], versions=[1], finish_reason="stop", stop_reason=2,
                                    routed_experts=[[[3, 0]]] * n2))
    (seg,) = led.segments()
    assert seg.routed_experts == [[[1, 2]]] * n1 + [[[3, 0]]] * (n2 - n1)
    assert seg.versions[-1] == 1 and seg.oldest_version() == 0


def test_bad_messages_raise_and_change_nothing(tok):
    led = Ledger(tok)
    for bad, where in [([], "empty"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
                       ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
                        "messages[0].tool_calls[0].function.arguments")]:
        with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
            led.prepare(bad)
    assert led.segments() == []


def test_template_refusal_is_a_value_error():
    tok2 = load_tokenizer("builtin:tiny-qwen3")
    tok2.chat_template = ("{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
                          "{{ raise_exception('system only first') }}{%- endif -%}{%- endfor -%}") + CHAT_TEMPLATE
    led = Ledger(tok2)
    with pytest.raises(ValueError, match="the chat template cannot render these messages: system only first"):
        led.prepare([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    assert led.segments() == []


def test_length_cut_turn_marks_truncated_and_ledger_info_wins(tok):
    """Issue 10 item 9: a generation cut by max_tokens (finish ``length``) marks the trajectory
    truncated even when a later turn ended normally; the ledger's own info keys cannot be
    overwritten by the caller's (the agent's) info."""
    eng = ScriptedEngine(tok, [enc(tok, "one two three four five six"), "ok"])  # ids without a stop id
    led = Ledger(tok)
    p1, t1 = turn(led, eng, [{"role": "user", "content": "q"}], params=SamplingParams(max_tokens=2))
    assert t1.finish_reason == "length" and len(t1.token_ids) == 2
    p2, t2 = turn(led, eng, led.history + [{"role": "user", "content": "more"}])
    assert p2.mode == "extend" and t2.finish_reason == "stop"
    lie = {"requests": {}, "context_reencoded_tokens": 0, "length_cut_turns": 0, "rewrite_causes": {}, "mine": 7}
    traj = led.trajectory(reward=1.0, info=lie)
    assert traj.truncated is True
    assert traj.info == {"mine": 7, "requests": {"start": 1, "extend": 1, "rewrite": 0, "retry": 0},
                         "context_reencoded_tokens": 0, "length_cut_turns": 1,
                         "rewrite_causes": dict.fromkeys(REWRITE_CAUSES, 0)}
    clean = Ledger(tok)
    turn(clean, ScriptedEngine(tok, ["ok"]), [{"role": "user", "content": "q"}])
    t = clean.trajectory(reward=1.0)
    assert t.truncated is False and t.info["length_cut_turns"] == 0
    assert clean.trajectory(truncated=True).truncated is True  # the caller can still say so


def test_reencoded_counts_the_whole_prompt_when_the_template_refuses_the_prefix(tok):
    """A template that cannot render the held prefix on its own (e.g. it must end on a user
    turn): the rewrite's whole prompt counts as re-encoded context."""
    eng = ScriptedEngine(tok, ["One.", "Two."])
    led = Ledger(tok)
    turn(led, eng, [{"role": "user", "content": "a"}])
    render = led.render

    def strict(messages, tools=None, add_generation_prompt=True):
        if not add_generation_prompt:
            raise ValueError("the chat template cannot render these messages: must end on a user turn")
        return render(messages, tools, add_generation_prompt)

    led.render = strict
    p2, _ = turn(led, eng, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Uno."},
                            {"role": "user", "content": "b"}])
    assert p2.mode == "rewrite" and p2.reencoded == len(p2.prompt_ids) > 0
    assert led.trajectory().info["context_reencoded_tokens"] == len(p2.prompt_ids)


@pytest.mark.parametrize("variant,want", [("prepend_system", 21), ("edit_first_user", 14), ("edit_reply", 7)])
def test_reencoded_counts_held_turns_after_an_edit_or_a_prepended_system_message(tok, variant, want):
    """Finding 4: a rewrite that prepends a system message or edits the first user message
    re-renders the held assistant reply from text; before, only a leading run of unchanged
    messages counted, so both read 0. Every held message the request repeats counts with its
    rendered tokens -- at least the reply's own ids plus its template frame."""
    reply = "The answer is forty two."
    eng = ScriptedEngine(tok, [reply, "Bye now."])
    led = Ledger(tok)
    turn(led, eng, [{"role": "user", "content": "hi"}])
    h = led.history
    if variant == "prepend_system":
        msgs = [{"role": "system", "content": "be brief"}] + h + [{"role": "user", "content": "bye"}]
    elif variant == "edit_first_user":
        msgs = [{"role": "user", "content": "hi!"}] + h[1:] + [{"role": "user", "content": "bye"}]
    else:  # the reply edited: only the held user turn is re-rendered
        msgs = h[:1] + [{"role": "assistant", "content": "Something else."}, {"role": "user", "content": "bye"}]
    p2, _ = turn(led, eng, msgs)
    assert p2.mode == "rewrite" and len(led.segments()) == 2
    user_frame = len(enc(tok, "<|im_start|>user\nhi<|im_end|>\n"))  # 7
    reply_frame = len(enc(tok, f"<|im_start|>assistant\n{reply}<|im_end|>\n"))
    assert reply_frame >= len(enc(tok, reply)) + 4
    assert p2.reencoded == want
    assert want == {"prepend_system": user_frame + reply_frame, "edit_first_user": reply_frame,
                    "edit_reply": user_frame}[variant]
    assert led.trajectory().info["context_reencoded_tokens"] == want


#: ids the builtin tiny Qwen3 sampled in the server load benchmark (issue 24 item 9), cut at 16:
#: "</think>\ufffd\ufffdobject sh\ufffd whC\u0689\ufffd\ufffd*</think>okread" (</think> = id 4)
CLOSE_IDS = [4, 190, 175, 425, 447, 243, 363, 43, 159, 240, 135, 134, 18, 4, 460, 476]


def test_rewrite_causes_counted_and_reported_at_ingress(tok):
    """Issue 24 item 9: each rewrite counts its cause in ``info["rewrite_causes"]`` and trainer
    ingress reports ``ledger/rewrite_cause/<cause>``; each cause injected once, and the clean
    echo (the reply sent back as received) reads 0 for every cause."""
    q = [{"role": "user", "content": "q"}]
    nxt = {"role": "user", "content": "next"}
    tok_unprobed = load_tokenizer("builtin:tiny-qwen3")  # renders no assistant turn: nothing to probe
    tok_unprobed.chat_template = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}\n{% endif %}{% endfor %}"
    cases = {  # cause -> (tokenizer, first reply, second request from the first turn's content, tools of the second)
        None: (tok, "Hi.", lambda c: q + [{"role": "assistant", "content": c}, nxt], None),
        "reply_edited": (tok, "Hi.", lambda c: q + [{"role": "assistant", "content": "Hello."}, nxt], None),
        "history_edited": (tok, "Hi.", lambda c: [{"role": "user", "content": "Q"}, {"role": "assistant", "content": c}, nxt], None),
        "tools_changed": (tok, "Hi.", lambda c: q + [{"role": "assistant", "content": c}, nxt], TOOLS),
        # echoed as sent ("okread"), but the template drops the text up to the last </think> of an
        # earlier turn once a new user turn follows: truly a rewrite
        "template_rewrites_history": (tok, CLOSE_IDS, lambda c: q + [{"role": "assistant", "content": c}, nxt], None),
        "template_unprobed": (tok_unprobed, "Hi.", lambda c: q + [{"role": "assistant", "content": c}, nxt], None),
    }
    trajs = {}
    for cause, (tk, first, second, tools2) in cases.items():
        led = Ledger(tk)
        eng = ScriptedEngine(tk, [first, "Ok."])
        _, t1 = turn(led, eng, q, params=SamplingParams(max_tokens=16))
        p2, _ = turn(led, eng, second(t1.content), tools=tools2)
        assert (p2.mode, p2.cause) == (("extend", None) if cause is None else ("rewrite", cause)), cause
        trajs[cause] = led.trajectory(reward=1.0)
        assert trajs[cause].info["rewrite_causes"] == {c: int(c == cause) for c in REWRITE_CAUSES}
    assert led.turn_close is None  # the last case's ledger
    held = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nokread<|im_end|>\n"  # re-encoded as context
    assert trajs["template_rewrites_history"].info["context_reencoded_tokens"] == len(enc(tok, held)) == 13
    _, clean = screen([trajs[None]])
    assert {k: v for k, v in clean.items() if k.startswith("ledger/rewrite_cause/")} == {
        "ledger/rewrite_cause/" + c: 0.0 for c in REWRITE_CAUSES}
    _, m = screen([t.model_copy(update={"rollout_id": str(c)}) for c, t in trajs.items()])
    assert {k: v for k, v in m.items() if k.startswith("ledger/rewrite_cause/")} == {
        "ledger/rewrite_cause/" + c: 1.0 for c in REWRITE_CAUSES}


def test_echoed_reply_extends_when_the_cut_falls_inside_reasoning(tok):
    """Issue 24 item 9, another member of the class: a turn cut by max_tokens inside the think
    block a generation prompt opened (the wire's content "", the committed text "<think>\\nplan
    and"), sent back exactly as the wire sent it, extends the segment."""
    tok2 = load_tokenizer("builtin:tiny-qwen3")
    gen = "'<|im_start|>assistant\\n'"
    i = CHAT_TEMPLATE.rfind(gen)
    tok2.chat_template = CHAT_TEMPLATE[:i] + "'<|im_start|>assistant\\n<think>\\n'" + CHAT_TEMPLATE[i + len(gen):]
    led = Ledger(tok2)
    cut = enc(tok2, "plan and more")[:4]  # "pl" "an" " an" "d"
    eng = ScriptedEngine(tok2, [cut, "Done."])
    msgs = [{"role": "user", "content": "a"}]
    p1, t1 = turn(led, eng, msgs, params=SamplingParams(max_tokens=4))
    assert (t1.content, t1.reasoning, t1.raw, t1.finish_reason) == ("", "plan and", "<think>\nplan and", "length")
    p2, _ = turn(led, eng, msgs + [{"role": "assistant", "content": "", "reasoning_content": "plan and"},
                                   {"role": "user", "content": "b"}])
    assert p2.mode == "extend" and len(led.segments()) == 1
    assert p2.tail_ids == enc(tok2, "<|im_end|>\n<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\n")


def _echo(t1, **edit):
    """The first turn's reply as the chat wire sends it (content, reasoning_content, calls with
    JSON-text arguments), with ``edit`` applied (``arguments``: the calls' new JSON text,
    ``call_id``: their new id)."""
    m = {"role": "assistant", "content": t1.content}
    if t1.reasoning is not None:
        m["reasoning_content"] = t1.reasoning
    if t1.tool_calls:
        args, cid = edit.pop("arguments", None), edit.pop("call_id", None)
        m["tool_calls"] = [{"id": cid or c["id"], "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["arguments"]) if args is None else args}} for c in t1.tool_calls]
    return {**m, **edit}


CALL_AB = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("first, edit, want", [
    ("Hi.", {}, "extend"),
    ("Hi.", {"content": "Hi. "}, "reply_edited"),  # trailing whitespace the template renders
    ("Hi.", {"content": "\nHi."}, "reply_edited"),
    ("<think>\nplan\n</think>\n\nHi.", {}, "extend"),
    ("<think>\nplan\n</think>\n\nHi.", {"reasoning_content": None}, "extend"),  # reasoning dropped
    ("<think>\nplan\n</think>\n\nHi.", {"reasoning_content": "other plan"}, "reply_edited"),
    ("<think>\nplan\n</think>\n\nHi.", {"reasoning_content": None, "content": "<think>\nother\n</think>\n\nHi."}, "reply_edited"),
    ("<think>\nplan and", {}, "extend"),  # an unclosed think block: content "", reasoning "plan and"
    ("<think>\nplan and", {"reasoning_content": "plan or"}, "reply_edited"),
    ("Do.\n" + CALL_AB, {}, "extend"),
    ("Do.\n" + CALL_AB, {"arguments": '{"a":1,"b":2}'}, "extend"),  # JSON spacing: the same object
    ("Do.\n" + CALL_AB, {"arguments": '{"b": 2, "a": 1}'}, "reply_edited"),  # key order: rendered apart
    ("Do.\n" + CALL_AB, {"arguments": '{"a": true, "b": 2}'}, "reply_edited"),  # 1 == True in Python
    ("Do.\n" + CALL_AB, {"arguments": '{"a": 1.0, "b": 2}'}, "reply_edited"),  # 1 == 1.0 in Python
    ("Do.\n" + CALL_AB, {"call_id": "call_mine"}, "reply_edited"),  # Mistral-family templates render ids
    ("Hi.", {"name": "bot"}, "reply_edited"),
], ids=["exact", "trailing-space", "leading-newline", "think-exact", "think-dropped", "think-edited",
        "think-inline-edited", "unclosed-exact", "unclosed-edited", "call-exact", "call-spacing",
        "call-key-order", "call-1-true", "call-1-float", "call-id", "name-added"])
def test_an_edited_echo_never_extends_with_the_original_ids(tok, first, edit, want):
    """Issue 24 item 9 review: a reply sent back exactly as the wire sent it (or with its
    reasoning left out: the ledger holds what the model produced) extends; one the client changed
    in anything the chat template renders -- outer whitespace, reasoning (field or inline),
    an argument's type or key order -- is a rewrite counted ``reply_edited``, so the next prompt
    is the client's history, never the original ids under an edited message; so is a call id
    or a name field changed (templates that render them exist). A tool turn follows: this
    template renders the last turn's reasoning there."""
    led = Ledger(tok)
    eng = ScriptedEngine(tok, [first, "Ok."])
    q = [{"role": "user", "content": "q"}]
    _, t1 = turn(led, eng, q, TOOLS)
    m = {k: v for k, v in _echo(t1, **edit).items() if v is not None}
    p2, _ = turn(led, eng, q + [m, {"role": "tool", "tool_call_id": "c", "content": "r"}], TOOLS)
    assert (p2.mode, p2.cause) == (("extend", None) if want == "extend" else ("rewrite", want))
    assert len(led.segments()) == (1 if want == "extend" else 2)
    assert led.trajectory().info["rewrite_causes"] == {c: int(c == want) for c in REWRITE_CAUSES}


def test_an_edited_earlier_call_or_schema_is_seen_past_the_fast_path_and_the_retry(tok):
    """Issue 24 item 9 review: the request-level comparisons (the fast path over the previous
    request, the retry key, the tools) took ``{"a": 1}`` and ``{"a": true}`` for one value:
    an earlier turn's call edited under an unedited last turn extended, the edited request was
    answered as a retry of the original, an edited tool schema kept the original's prompt."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    eng = ScriptedEngine(tok, [call, call, "Done.", "Again."])
    led = Ledger(tok)
    q = [{"role": "user", "content": "q"}]
    _, t1 = turn(led, eng, q, TOOLS)
    m2 = q + [_echo(t1), {"role": "tool", "tool_call_id": "1", "content": "2"}]
    p2, t2 = turn(led, eng, m2, TOOLS)
    assert p2.mode == "extend"
    edited = q + [_echo(t1, arguments='{"a": true}')] + m2[2:]
    p = led.prepare(edited, TOOLS, SamplingParams())  # was answered as a retry of m2 (t2 again)
    assert (p.mode, p.cause, p.cached) == ("rewrite", "history_edited", None)
    p3 = led.prepare(edited + [_echo(t2), {"role": "tool", "tool_call_id": "2", "content": "3"}], TOOLS, SamplingParams())
    assert (p3.mode, p3.cause) == ("rewrite", "reply_edited")  # turn 1 edited, turn 2 exact
    moved = m2[:2] + [{**m2[2], "tool_call_id": "9"}, _echo(t2), {"role": "tool", "tool_call_id": "2", "content": "3"}]
    p3 = led.prepare(moved, TOOLS, SamplingParams())
    assert (p3.mode, p3.cause) == ("rewrite", "history_edited")  # a tool result's id edited: ignored before
    tools2 = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "default": 1}}}}}]
    tools3 = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "default": True}}}}}]
    led4 = Ledger(tok)
    _, t = turn(led4, ScriptedEngine(tok, ["Hi.", "Ok."]), q, tools2)
    p = led4.prepare(q + [_echo(t), {"role": "user", "content": "n"}], tools3, SamplingParams())
    assert (p.mode, p.cause) == ("rewrite", "tools_changed")
