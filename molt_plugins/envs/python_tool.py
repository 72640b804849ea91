"""``python_tool``: multi-turn problem solving with a sandboxed Python interpreter as a tool.

Problems and grading come from a reasoning-gym task (the ``reasoning_gym`` env's options).
Two forms share them:

* :class:`PythonToolEnv` (``python_tool``) -- an :class:`Env`: the model writes a tool call
  in the Hermes / Qwen format ``<tool_call>{"name": "python", "arguments": {"code": "..."}}
  </tool_call>``; the env runs the code in :mod:`molt_plugins.sandbox` and returns
  ``<tool_response>stdout</tool_response>`` as the next observation. A reply without a
  tool call is the final answer, graded by the task's ``score_answer``. After
  ``max_turns`` replies the episode is truncated and the last reply is graded.
* :class:`PythonToolChatAgent` (``python_tool_chat``) -- a :class:`ChatAgent` that does the
  same through the stock OpenAI SDK with structured ``tools=`` against
  ``ctx.openai_base_url`` (the run's loopback server, or any OpenAI-compatible endpoint).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Iterator

from pydantic import Field

from molt_core.agents import AgentContext, ChatAgent, EpisodeState
from molt_core.types import Result
from molt_plugins.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymOptions
from molt_plugins.sandbox import run_python

__all__ = ["PythonToolOptions", "PythonToolEnv", "PythonToolChatAgent", "parse_tool_calls", "run_tool",
           "PYTHON_TOOL", "DEFAULT_SYSTEM_PROMPT", "CHAT_SYSTEM_PROMPT"]

#: The tool's OpenAI function schema (``tools=[PYTHON_TOOL]``).
PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program in a sandbox and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python program to run."}},
            "required": ["code"],
        },
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "You can run Python. To run code, reply with exactly\n"
    '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call>\n'
    "and you will get its output in <tool_response></tool_response>. "
    "When you know the answer, reply with the answer only."
)

#: What :class:`PythonToolChatAgent` sends instead of the default (the SDK carries the schema).
CHAT_SYSTEM_PROMPT = "You can run Python with the `python` tool. When you know the answer, reply with the answer only."

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class PythonToolOptions(ReasoningGymOptions):
    """Options: every ``reasoning_gym`` option (problem source and grading) plus

    * ``max_turns`` -- model replies per episode (tool calls + the final answer).
    * ``timeout_s`` / ``memory_mb`` -- sandbox limits per tool call.
    * ``max_output_chars`` -- tool output shown to the model (the tail is kept).
    * ``system_prompt`` -- defaults to :data:`DEFAULT_SYSTEM_PROMPT` (describes the call
      format); set ``""`` for none.
    """

    max_turns: int = Field(4, ge=1)
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(512, ge=16)
    max_output_chars: int = Field(2000, ge=1)
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Tool calls in ``text``: each ``<tool_call>{json}</tool_call>`` as ``{"name",
    "arguments"}``; a call whose JSON is malformed is returned as ``{"error": message}``.

    JSON-aware: a ``</tool_call>`` inside a JSON string (``print("</tool_call>")``) does not
    end the call (issue 12 item 6)."""
    calls: list[dict[str, Any]] = []
    dec, i = json.JSONDecoder(), 0
    while (a := text.find("<tool_call>", i)) >= 0:
        j = a + len("<tool_call>")
        while j < len(text) and text[j].isspace():
            j += 1
        try:
            obj, k = dec.raw_decode(text, j)
            while k < len(text) and text[k].isspace():
                k += 1
            if not text.startswith("</tool_call>", k):
                raise json.JSONDecodeError("extra data after the JSON object", text, k)
            i = k + len("</tool_call>")
        except json.JSONDecodeError:
            m = _TOOL_CALL.match(text, a)
            if m is None:  # no closing tag at all: nothing more to parse
                break
            try:
                json.loads(m.group(1))
                calls.append({"error": "tool call must hold one JSON object"})
            except json.JSONDecodeError as e:
                calls.append({"error": f"tool call is not valid JSON ({e.msg} at char {e.pos})"})
            i = m.end()
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append({"error": 'tool call must be {"name": ..., "arguments": {...}}'})
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"code": args}
        calls.append({"name": obj["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls


def run_tool(call: dict[str, Any], timeout_s: float, memory_mb: int, max_output_chars: int) -> str:
    """Execute one parsed tool call and return the text shown to the model.

    Unknown tools, missing ``code`` and malformed calls come back as an error message
    (the model can correct itself); a sandbox timeout or memory kill is reported likewise
    -- it is the tool's result, not a reward failure.
    """
    if "error" in call:
        return f"Error: {call['error']}"
    if call.get("name") != "python":
        return f"Error: unknown tool {call.get('name')!r}; the only tool is 'python'"
    code = call.get("arguments", {}).get("code")
    if not isinstance(code, str):
        return 'Error: the python tool needs arguments {"code": "<program>"}'
    res = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max(4 * max_output_chars, 65536))
    out = res.stdout + (("\n" if res.stdout and not res.stdout.endswith("\n") else "") + res.stderr if res.stderr else "")
    if res.status == "timeout":
        out += f"\nTimeoutError: the program ran longer than {timeout_s:g} s and was killed"
    elif res.status == "memory":
        out += f"\nMemoryError: the program used more than {memory_mb} MiB"
    elif res.status == "output_limit":
        out += "\n(output truncated: the program printed too much)"
    out = out.strip("\n")
    if len(out) > max_output_chars:
        out = "..." + out[-max_output_chars:]
    return out


def _final_text(text: str) -> str:
    """``text`` with tool-call blocks removed (what is graded as an answer)."""
    return _TOOL_CALL.sub("", text).strip()


class PythonToolEnv(ReasoningGymEnv):
    """Multi-turn Env with a sandboxed Python tool (see the module docstring).

    ``step``: a reply with tool calls (turn < ``max_turns - 1``) -> ``reward 0``, observation
    ``<tool_response>...</tool_response>`` (one block per call); a reply without one -> graded,
    ``terminated``; the ``max_turns``-th reply -> graded (tool calls stripped), ``truncated``
    if it still called a tool. ``info["tool_calls"]`` counts the calls of the turn.
    """

    Options = PythonToolOptions
    molt_example = {"options": {"task": "basic_arithmetic", "size": 16, "eval_size": 4}}
    """Options for ``molt plugins --check`` (``task`` has no default)."""

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """One turn; see the class docstring."""
        o: PythonToolOptions = self.options
        calls = parse_tool_calls(action_text)
        last = state.turn >= o.max_turns - 1
        if calls and not last:
            outs = [run_tool(c, o.timeout_s, o.memory_mb, o.max_output_chars) for c in calls]
            obs = "\n".join(f"<tool_response>\n{x}\n</tool_response>" for x in outs)
            return Result(reward=0.0, observation=obs, info={"tool_calls": len(calls)})
        s = self.score(_final_text(action_text), state.task)
        r = o.reward_weight * ((1.0 if s == 1.0 else 0.0) if o.binary else s)
        return Result(reward=r, score=s, terminated=not calls, truncated=bool(calls),
                      info={"tool_calls": len(calls), "turns": state.turn + 1})


class PythonToolChatAgent(ChatAgent):
    """The same task through the OpenAI SDK with structured tool calls (``tools=``).

    Loop: ``chat.completions.create(model=ctx.model, messages, tools=[PYTHON_TOOL], ...)``;
    each returned ``tool_calls`` entry runs in the sandbox and is answered with a ``tool``
    message; a reply without tool calls is the final answer (graded). ``reward`` is the
    graded score; ``truncated`` when ``max_turns`` replies all called tools.
    """

    Options = PythonToolOptions
    molt_example = {"options": {"task": "basic_arithmetic", "size": 16, "eval_size": 4}}
    """Options for ``molt plugins --check`` (``task`` has no default)."""
    molt_requires = ReasoningGymEnv.molt_requires  # its problems come from reasoning-gym

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        fields = set(ReasoningGymOptions.model_fields)
        self._rg = ReasoningGymEnv(**{k: v for k, v in self.options.model_dump().items() if k in fields})

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Same tasks as the ``reasoning_gym`` env with these options."""
        return self._rg.tasks(split, seed)

    async def run(self, ctx: AgentContext) -> Result:
        """One episode through ``ctx.openai_base_url`` with ``ctx.api_key``."""
        from openai import AsyncOpenAI

        o: PythonToolOptions = self.options
        client = AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        messages: list[dict[str, Any]] = []
        system = CHAT_SYSTEM_PROMPT if o.system_prompt == DEFAULT_SYSTEM_PROMPT else o.system_prompt
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": self._rg.reset(ctx.task)})
        sp = ctx.sampling
        kwargs: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": sp.max_tokens}
        if sp.seed is not None:
            kwargs["seed"] = sp.seed
        n_calls = 0
        content = ""
        try:
            for turn in range(o.max_turns):
                resp = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[PYTHON_TOOL],
                                                            **kwargs)
                msg = resp.choices[0].message
                content = msg.content or ""
                calls = list(msg.tool_calls or [])
                if not calls:
                    s = self._rg.score(content, ctx.task)
                    return Result(reward=o.reward_weight * ((1.0 if s == 1.0 else 0.0) if o.binary else s), score=s,
                                  terminated=True,
                                  info={"tool_calls": n_calls, "turns": turn + 1})
                messages.append({
                    "role": "assistant", "content": msg.content,
                    "tool_calls": [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in calls],
                })
                for c in calls:
                    n_calls += 1
                    try:
                        args = json.loads(c.function.arguments or "{}")
                        call = {"name": c.function.name, "arguments": args if isinstance(args, dict) else {}}
                    except json.JSONDecodeError as e:
                        call = {"error": f"arguments are not valid JSON ({e.msg})"}
                    out = await asyncio.to_thread(run_tool, call, o.timeout_s, o.memory_mb, o.max_output_chars)
                    messages.append({"role": "tool", "tool_call_id": c.id, "content": out})
        finally:
            await client.close()
        s = self._rg.score(_final_text(content), ctx.task)
        return Result(reward=o.reward_weight * ((1.0 if s == 1.0 else 0.0) if o.binary else s), score=s, truncated=True,
                      info={"tool_calls": n_calls, "turns": o.max_turns})
