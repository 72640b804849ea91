"""Tool results matched to their calls, on every wire, before anything is rendered.

A chat template renders a tool result as the answer to a call of the assistant turn before it
by *position*, whatever its id says (Qwen's ``<tool_response>`` blocks carry no id), so the
server checks each result against the ids the OpenAI Chat (``tool_call_id``), Anthropic
(``tool_use_id``) and Responses (``call_id``) APIs match it by, and hands the ledger each
turn's results in the order of its calls -- the order the model wrote them in.
"""

from __future__ import annotations

from typing import Any

from molt_core.server.wires import WireError

__all__ = ["match_tool_results"]


def match_tool_results(messages: list[Any], fields: list[str]) -> list[Any]:
    """Refuse a tool result that matches no call, or a call answered twice; return the
    messages with each run of consecutive tool results in the order of the calls they answer.

    A result must name a call of the nearest assistant turn before it (consecutive assistant
    messages are one turn, as the Anthropic API merges consecutive same-role turns), that call
    only (ids unique in the turn), and once. The API matches results to calls by id, in any
    order; the template matches them by position, so a run of results is sorted (stably) into
    call order -- deterministically, so a client that re-sends the conversation still extends
    the ledger's history.

    Args:
        messages: the conversation in OpenAI form (assistant ``tool_calls[*].id``, ``role: tool``
            messages with ``tool_call_id``), as a wire converted it; malformed entries are skipped
            (the ledger names them).
        fields: the wire field of each of the request's own tool results, in order: the last
            ``len(fields)`` tool messages (earlier ones come from a stored response, checked when
            sent; a stored conversation ends on its assistant turn, so they share no run).

    Returns:
        A new list of the same message objects; only tool messages move, within their run.

    Raises:
        WireError: 400 (``code`` ``invalid_tool_result``) whose ``param`` and message name the
            result's field: its id is missing, names no call of the assistant turn before it,
            names several, or names a call answered already.
    """
    stored = sum(isinstance(m, dict) and m.get("role") == "tool" for m in messages) - len(fields)
    out = list(messages)
    calls: list[str] = []
    answered: dict[str, str] = {}  # call id -> the field of the result that answered it
    run: list[int] = []  # positions of the current run of tool messages
    k, prev = 0, None
    for i, m in enumerate([*messages, None]):  # None closes the last run
        role = m.get("role") if isinstance(m, dict) else None
        if role != "tool" and len(run) > 1:
            order = sorted((out[j] for j in run), key=lambda t: calls.index(t["tool_call_id"]))
            for j, t in zip(run, order):
                out[j] = t
        if role != "tool":
            run = []
        if role == "assistant":
            tc = m["tool_calls"] if isinstance(m.get("tool_calls"), list) else []
            ids = [str(c.get("id") or "") for c in tc if isinstance(c, dict)]
            calls, answered = (calls + ids, answered) if prev == "assistant" else (ids, {})
        elif role == "tool":
            tid, k = m.get("tool_call_id"), k + 1
            if k <= stored:  # a stored response's result: checked and ordered when it was sent
                answered.setdefault(str(tid), "a stored result")
            else:
                _check(tid, calls, answered, fields[k - stored - 1])
                run.append(i)
        prev = role
    return out


def _check(tid: Any, calls: list[str], answered: dict[str, str], field: str) -> None:
    """One result of the request (its id ``tid``, at ``field``) against the turn's ``calls``;
    records it in ``answered``. Raises: WireError as :func:`match_tool_results`."""
    shown = ", ".join(repr(c) for c in calls if c) or "none"
    if not isinstance(tid, str) or not tid:
        why = f" must be the id of the call this result answers, one of the assistant turn before it ({shown}); got {tid!r}"
    elif tid not in calls:
        why = (f"={tid!r} names no tool call of the assistant turn before it (its calls: {shown}); "
               "send the id of the call this result answers")
    elif calls.count(tid) > 1:
        why = f"={tid!r} names {calls.count(tid)} calls of the assistant turn before it; give each call its own id"
    elif tid in answered:
        why = f"={tid!r} answers a call already answered by {answered[tid]}; send one result per call"
    else:
        answered[tid] = field
        return
    raise WireError(400, field + why, field, "invalid_tool_result")
