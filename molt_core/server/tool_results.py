"""Tool results matched to their calls, on every wire, before anything is rendered: a chat template
renders a result as the answer to a call by *position* (Qwen's ``<tool_response>`` carries no id), so
each result is checked against the id its API matches by and each turn's results are put in call order.
"""

from __future__ import annotations

from typing import Any

from molt_core.server.wires import WireError

__all__ = ["match_tool_results"]


def match_tool_results(messages: list[Any], fields: list[str]) -> list[Any]:
    """Refuse a tool result that matches no call, or a call answered twice; return the messages with each
    run of consecutive tool results stably sorted into the order of the calls they answer.

    A result must name exactly one call of the nearest assistant turn before it (consecutive assistant
    messages are one turn), once.

    Args:
        messages: the conversation in OpenAI form, as a wire converted it (malformed entries skipped).
        fields: the wire field of each of the request's own tool results (the last ``len(fields)`` tool
            messages; earlier ones come from a stored response, checked when sent).

    Returns:
        A new list of the same message objects; only tool messages move, within their run.

    Raises:
        WireError: 400 (``invalid_tool_result``) naming the result's field: its id is missing, names no
            call of the turn before it, names several, or names a call answered already.
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
    """Check result ``tid`` (at ``field``) against ``calls``; record it in ``answered``. Raises: WireError."""
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
