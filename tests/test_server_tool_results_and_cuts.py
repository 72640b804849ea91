"""Issue 24 items 6 and 7 on every wire, driven by the real openai and anthropic SDKs.

6. A tool result must answer a call of the assistant turn before it, once: OpenAI chat
   ``tool_call_id``, Anthropic ``tool_use_id``, Responses ``call_id``. A result naming no call,
   or a call answered twice, is a 400 naming the field; the engine is not called and nothing is
   recorded (a chat template renders a result as the answer to the call before it, whatever its
   id says, so an accepted one would be shown to the model as another call's result).
7. A turn cut by ``max_tokens`` reports the cut on every wire, streamed or not, whatever the cut
   text holds (a complete tool call included): chat ``finish_reason`` ``length``, Anthropic
   ``stop_reason`` ``max_tokens``, Responses ``status`` ``incomplete`` with
   ``incomplete_details.reason`` ``max_output_tokens``; the recorded segment's finish reason is
   ``length`` and the trajectory is truncated.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch

from fake_engine import ScriptedEngine
from molt_core.models import load_tokenizer
from molt_core.server import start_server
from molt_core.server.tool_results import match_tool_results
from molt_core.server.wires import WireError

torch.set_num_threads(1)

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
A_TOOLS = [{"name": "add", "input_schema": {"type": "object", "properties": {}}}]
R_TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {}}}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


@pytest.fixture(scope="module")
def server(tok):
    eng = ScriptedEngine(tok, [])
    h = start_server(eng, tok)
    yield h, eng
    h.stop()


def _chat_calls(ids):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "add", "arguments": "{}"}} for i in ids]}


def _anthropic_calls(ids):
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "add", "input": {}} for i in ids]}


def _fc(i):
    return {"type": "function_call", "call_id": i, "name": "add", "arguments": "{}"}


# wire -> case -> (request payload, the field named, the exact error message)
RESULTS = {
    "chat": {
        "unknown": ([{"role": "user", "content": "add"}, _chat_calls(["call_a"]),
                     {"role": "tool", "tool_call_id": "call_x", "content": "5"}],
                    "messages[2].tool_call_id",
                    "messages[2].tool_call_id='call_x' names no tool call of the assistant turn before it (its calls: "
                    "'call_a'); send the id of the call this result answers"),
        "twice": ([{"role": "user", "content": "add"}, _chat_calls(["call_a", "call_b"]),
                   {"role": "tool", "tool_call_id": "call_a", "content": "5"},
                   {"role": "tool", "tool_call_id": "call_a", "content": "6"}],
                  "messages[3].tool_call_id",
                  "messages[3].tool_call_id='call_a' answers a call already answered by messages[2].tool_call_id; "
                  "send one result per call"),
        # a call of an earlier turn is not a call of the turn before the result
        "earlier": ([{"role": "user", "content": "add"}, _chat_calls(["call_a"]),
                     {"role": "tool", "tool_call_id": "call_a", "content": "5"}, _chat_calls(["call_b"]),
                     {"role": "tool", "tool_call_id": "call_a", "content": "6"}],
                    "messages[4].tool_call_id",
                    "messages[4].tool_call_id='call_a' names no tool call of the assistant turn before it (its calls: "
                    "'call_b'); send the id of the call this result answers"),
    },
    "anthropic": {
        "unknown": ([{"role": "user", "content": "add"}, _anthropic_calls(["toolu_a"]),
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "5"}]}],
                    "messages[2].content[0].tool_use_id",
                    "messages[2].content[0].tool_use_id='toolu_x' names no tool call of the assistant turn before it "
                    "(its calls: 'toolu_a'); send the id of the call this result answers"),
        "twice": ([{"role": "user", "content": "add"}, _anthropic_calls(["toolu_a", "toolu_b"]),
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "5"},
                                                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "6"}]}],
                  "messages[2].content[1].tool_use_id",
                  "messages[2].content[1].tool_use_id='toolu_a' answers a call already answered by "
                  "messages[2].content[0].tool_use_id; send one result per call"),
        "missing": ([{"role": "user", "content": "add"}, _anthropic_calls(["toolu_a"]),
                     {"role": "user", "content": [{"type": "tool_result", "content": "5"}]}],
                    "messages[2].content[0].tool_use_id",
                    "messages[2].content[0].tool_use_id must be the id of the call this result answers, one of the "
                    "assistant turn before it ('toolu_a'); got ''"),
    },
    "responses": {
        "unknown": ([{"role": "user", "content": "add"}, _fc("call_a"),
                     {"type": "function_call_output", "call_id": "call_x", "output": "5"}],
                    "input[2].call_id",
                    "input[2].call_id='call_x' names no tool call of the assistant turn before it (its calls: "
                    "'call_a'); send the id of the call this result answers"),
        "twice": ([{"role": "user", "content": "add"}, _fc("call_a"), _fc("call_b"),
                   {"type": "function_call_output", "call_id": "call_a", "output": "5"},
                   {"type": "function_call_output", "call_id": "call_a", "output": "6"}],
                  "input[4].call_id",
                  "input[4].call_id='call_a' answers a call already answered by input[3].call_id; send one result "
                  "per call"),
        "ambiguous": ([{"role": "user", "content": "add"}, _fc("call_a"), _fc("call_a"),
                       {"type": "function_call_output", "call_id": "call_a", "output": "5"}],
                      "input[3].call_id",
                      "input[3].call_id='call_a' names 2 calls of the assistant turn before it; give each call its "
                      "own id"),
    },
}


def _send(wire, info, payload, stream, max_tokens=64):
    """One request on ``wire`` through its SDK; returns what the SDK returned (streams drained)."""
    if wire == "anthropic":
        c = anthropic.Anthropic(base_url=info.anthropic_base_url, api_key=info.api_key, max_retries=0)
        kw = dict(model="m", max_tokens=max_tokens, messages=payload, tools=A_TOOLS)
        if not stream:
            return c.messages.create(**kw)
        with c.messages.stream(**kw) as st:
            return [ev.type for ev in st], st.get_final_message()
    c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0)
    if wire == "chat":
        out = c.chat.completions.create(model="m", messages=payload, tools=CHAT_TOOLS, max_tokens=max_tokens,
                                        stream=stream)
    else:
        out = c.responses.create(model="m", input=payload, tools=R_TOOLS, max_output_tokens=max_tokens, stream=stream)
    return list(out) if stream else out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire,case", [(w, c) for w in RESULTS for c in RESULTS[w]])
def test_tool_result_matching_no_call_is_a_400_naming_the_field(server, wire, case, stream):
    h, eng = server
    info = h.create_session()
    payload, field, message = RESULTS[wire][case]
    calls = eng.calls
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as e:
        _send(wire, info, payload, stream)
    assert e.value.status_code == 400
    if wire == "anthropic":
        assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": message,
                                                           "details": {"error_code": "invalid_tool_result"}}}
    else:
        assert e.value.body == {"message": message, "type": "invalid_request_error", "param": field,
                                "code": "invalid_tool_result"}
    assert eng.calls == calls and h.trajectory(info.session_id).segments == []  # the engine was not called


@pytest.mark.parametrize("wire", list(RESULTS))
def test_tool_results_answering_each_call_once_are_accepted(server, wire):
    """The clean case: each call answered once, in any order, is served (200) and recorded."""
    h, eng = server
    info = h.create_session()
    if wire == "chat":
        payload = [{"role": "user", "content": "add"}, _chat_calls(["call_a", "call_b"]),
                   {"role": "tool", "tool_call_id": "call_b", "content": "6"},
                   {"role": "tool", "tool_call_id": "call_a", "content": "5"}]
    elif wire == "anthropic":
        payload = [{"role": "user", "content": "add"}, _anthropic_calls(["toolu_a", "toolu_b"]),
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "5"}
                                                for i in ("toolu_b", "toolu_a")]}]
    else:
        payload = [{"role": "user", "content": "add"}, _fc("call_a"), _fc("call_b"),
                   *[{"type": "function_call_output", "call_id": i, "output": "5"} for i in ("call_b", "call_a")]]
    eng.replies[:] = ["Five."]
    calls = eng.calls
    out = _send(wire, info, payload, False)
    text = {"chat": lambda: out.choices[0].message.content, "anthropic": lambda: out.content[0].text,
            "responses": lambda: out.output_text}[wire]()
    assert text == "Five." and eng.calls == calls + 1 and len(h.trajectory(info.session_id).segments) == 1


def test_match_tool_results_counts_a_stored_prefix():
    """Results before the request's own (a stored response's, e.g. through ``previous_response_id``)
    are not named, but a call they answered cannot be answered again, and their calls stay open."""
    msgs = [{"role": "user", "content": "add"}, _chat_calls(["a", "b"]), {"role": "tool", "tool_call_id": "a", "content": "5"}]
    match_tool_results(msgs + [{"role": "tool", "tool_call_id": "b", "content": "6"}], ["input[0].call_id"])
    with pytest.raises(WireError) as e:
        match_tool_results(msgs + [{"role": "tool", "tool_call_id": "a", "content": "6"}], ["input[0].call_id"])
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "input[0].call_id", "input[0].call_id='a' answers a call already answered by a stored result; "
                                 "send one result per call")
    match_tool_results([{"role": "tool", "content": "x"}], [])  # an Env's history: nothing of the request's own


def _results(wire, ids_texts):
    """``wire``'s tool results for ``[(call id, text), ...]``, in the order given."""
    if wire == "chat":
        return [{"role": "tool", "tool_call_id": i, "content": t} for i, t in ids_texts]
    if wire == "anthropic":
        return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": t}
                                             for i, t in ids_texts]}]
    return [{"type": "function_call_output", "call_id": i, "output": t} for i, t in ids_texts]


# wire -> the assistant turn calling "a" then "b": one message, or (Anthropic) two consecutive
# assistant messages, which the Anthropic API merges into one turn
TURNS = {"chat": [_chat_calls(["a", "b"])], "anthropic": [_anthropic_calls(["a", "b"])],
         "anthropic-split": [_anthropic_calls(["a"]), _anthropic_calls(["b"])], "responses": [_fc("a"), _fc("b")]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("turn", list(TURNS))
def test_results_reach_the_model_in_the_order_of_their_calls(tok, server, turn, stream):
    """The APIs match results to calls by id, in any order; the template by position (Qwen's
    ``<tool_response>`` carries no id), so results sent b-then-a are rendered a-then-b: the
    engine's prompt equals the in-order request's. Re-sending the conversation extends it."""
    h, eng = server
    wire = turn.split("-")[0]
    head = [{"role": "user", "content": "add"}, *TURNS[turn]]
    swapped, in_order = (head + _results(wire, o) for o in ([("b", "six"), ("a", "five")], [("a", "five"), ("b", "six")]))
    info, prompts = h.create_session(), []
    for payload in (in_order, swapped):
        eng.replies[:] = ["Done."]
        _send(wire, h.create_session() if payload is in_order else info, payload, stream)
        prompts.append(eng.prompts[-1])
    assert tok.decode(prompts[0]).endswith("<tool_response>\nfive\n</tool_response>\n<tool_response>\nsix\n"
                                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert prompts[1] == prompts[0]
    # the swapped conversation re-sent whole with the reply and a new user turn: extended, nothing re-encoded
    eng.replies[:] = ["Bye."]
    _send(wire, info, swapped + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "thanks"}], stream)
    traj = h.trajectory(info.session_id)
    assert traj.info["requests"] == {"start": 1, "extend": 1, "rewrite": 0, "retry": 0}
    assert traj.info["context_reencoded_tokens"] == 0 and len(traj.segments) == 1


class _Aborting(ScriptedEngine):
    """A :class:`ScriptedEngine` whose every generation ends ``abort`` (an engine-side cancel)."""

    async def generate(self, prompt_ids, params, images=None):
        out = await super().generate(prompt_ids, params)
        return out.model_copy(update={"finish_reason": "abort", "stop_reason": None})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", ["chat", "anthropic", "responses"])
def test_an_aborted_generation_is_a_503_and_records_nothing(tok, wire, stream):
    """An aborted generation was cut, but no wire has a stop reason for that cut (it was served as
    ``stop`` / ``tool_use`` / ``completed``, a call parsed from the cut text): the server answers
    503 (the SDKs retry it) and commits nothing."""
    eng = _Aborting(tok, [f"Adding.\n{CALL}"])
    h = start_server(eng, tok)
    try:
        info = h.create_session()
        with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)) as e:
            _send(wire, info, [{"role": "user", "content": "add 2 and 3"}], stream)
        assert e.value.status_code == 503 and eng.calls == 1
        n = len(tok.encode(f"Adding.\n{CALL}", add_special_tokens=False)) + 1  # the reply and its stop id
        message = f"the engine aborted the generation after {n} tokens; nothing was recorded: retry the request"
        if wire == "anthropic":
            assert e.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        else:
            assert e.value.body == {"message": message, "type": "server_error", "param": None, "code": None}
        assert h.trajectory(info.session_id).segments == []
    finally:
        h.stop()


def test_only_adjacent_assistant_messages_are_one_turn():
    """A user message between two assistant messages ends the first turn: its call is not open."""
    msgs = [{"role": "user", "content": "add"}, _chat_calls(["a"]), {"role": "user", "content": "and"}, _chat_calls(["b"]),
            {"role": "tool", "tool_call_id": "a", "content": "5"}]
    with pytest.raises(WireError) as e:
        match_tool_results(msgs, ["messages[4].tool_call_id"])
    assert (e.value.param, e.value.message) == ("messages[4].tool_call_id", "messages[4].tool_call_id='a' names no tool "
                                                "call of the assistant turn before it (its calls: 'b'); send the id of "
                                                "the call this result answers")
    b, a = ({"role": "tool", "tool_call_id": i, "content": i} for i in "ba")
    out = match_tool_results(msgs[:1] + [_chat_calls(["a"]), _chat_calls(["b"]), b, a], ["x", "y"])
    assert out[3:] == [a, b] and out[3] is a  # the same objects, in call order


# what the cut text holds: a complete tool call, plain text, an unclosed think block
CUTS = [f"Adding.\n{CALL}", "one two three", "<think>\nstill thinking"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", CUTS)
@pytest.mark.parametrize("wire", ["chat", "anthropic", "responses"])
def test_length_cut_reported_as_a_cut_on_every_wire(tok, server, wire, text, stream):
    h, eng = server
    info = h.create_session()
    ids = tok.encode(text, add_special_tokens=False)  # max_tokens = exactly these: the stop id is never sampled
    eng.replies[:] = [text]
    out = _send(wire, info, [{"role": "user", "content": "add 2 and 3"}], stream, max_tokens=len(ids))
    if wire == "chat":
        if stream:
            finish = [c.choices[0].finish_reason for c in out if c.choices and c.choices[0].finish_reason]
            got = [t for c in out if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
            assert finish == ["length"] and got == ids
        else:
            assert out.choices[0].finish_reason == "length" and out.choices[0].token_ids == ids
            if text.endswith(CALL):  # the complete call is still returned; the cut is not hidden
                call = out.choices[0].message.tool_calls[0].function
                assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
    elif wire == "anthropic":
        if stream:
            events, out = out
            assert events[-2:] == ["message_delta", "message_stop"]
        assert out.stop_reason == "max_tokens" and out.stop_sequence is None and out.model_extra["token_ids"] == ids
        if text.endswith(CALL):
            assert out.content[-1].type == "tool_use" and out.content[-1].input == {"a": 2, "b": 3}
    else:
        if stream:
            assert out[-1].type == "response.incomplete" and not any(ev.type == "response.completed" for ev in out)
            out = out[-1].response
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
        assert out.model_extra["token_ids"] == ids
    traj = h.trajectory(info.session_id)
    (seg,) = traj.segments
    assert seg.finish_reason == "length" and traj.truncated is True and traj.info["length_cut_turns"] == 1
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == ids
