"""Rewards through the rollout worker (issue 11 items 3, 4 and the Reward API v2 on every call
path): the Env path (``Result.reward`` and reward plugins), the ChatAgent path, the eval
path, and per-component metrics from ``assemble_batch``."""

from __future__ import annotations

import asyncio
import math
import textwrap
import time

import pytest

from molt_core.config import RunConfig
from molt_core.runtime import RolloutWorker, assemble_batch

ENV = '''
from molt_core.agents import Env
from molt_core.types import Result

class Counting(Env):
    """Task i: reward i / 4, except task 3 whose Result.reward is NaN (built) and task 5 whose
    reward is set to inf after construction (pydantic does not re-validate assignment)."""
    def tasks(self, split, seed):
        i = 0
        while True:
            yield {"i": i}
            i += 1
    def reset(self, task):
        return "Say something."
    def step(self, action_text, state):
        i = state.task["i"]
        if i == 3:
            return Result(reward=float("nan"), terminated=True)
        r = Result(reward=i / 4, terminated=True)
        if i == 5:
            r.reward = float("inf")
        return r
'''

CHAT = '''
import openai
from molt_core.agents import ChatAgent
from molt_core.types import Result

class Chat(ChatAgent):
    """Samples one reply; task "nan" returns a NaN reward (set after construction, as a
    ChatAgent may), task "float" returns a bare float instead of a Result."""
    def tasks(self, split, seed):
        while True:
            yield {"kind": "ok"}
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        await client.close()
        if ctx.task["kind"] == "float":
            return 1.0
        r = Result(reward=0.5, terminated=True)
        if ctx.task["kind"] == "nan":
            r.reward = float("nan")
        return r
'''

PLUGIN = '''
import asyncio, math
from molt_core.hookspecs import hookimpl
from molt_core.rewards import group_reward

def odd_nan(response, task):
    """NaN on odd tasks, 1.0 on even ones."""
    return math.nan if task.get("i", 0) % 2 else 1.0

async def quarter(response, task):
    await asyncio.sleep(0)
    return 0.25

def turns(response, task, trajectory):
    return float(len(trajectory.messages) * 10 + trajectory.turns)

@group_reward
def rank(responses, tasks):
    return [float(k) for k in range(len(responses))]

def hang(response, task):
    import time
    time.sleep(20)
    return 1.0

@hookimpl
def molt_register_rewards(register):
    register("odd_nan", odd_nan)
    register("quarter", quarter)
    register("turns", turns)
    register("rank", rank)
    register("hang", hang)
'''


def worker(tmp_path, agent, rewards=None, **rollout):
    (tmp_path / "agent.py").write_text(textwrap.dedent(agent))
    (tmp_path / "plug.py").write_text(textwrap.dedent(PLUGIN))
    data = {"agent": {"path": str(tmp_path / "agent.py")}, "plugins": [str(tmp_path / "plug.py")],
            "rollout": {"max_tokens": 3, **rollout}, "rewards": rewards or {}}
    return RolloutWorker(RunConfig.model_validate(data))


def test_env_result_reward_non_finite_fails_that_trajectory(tmp_path):
    w = worker(tmp_path, ENV)
    groups = asyncio.run(w.rollout([{"i": 2}, {"i": 3}, {"i": 5}], 2))
    assert [t.reward for t in groups[0].trajectories] == [0.5, 0.5]
    for g in groups[1:]:  # built NaN: Result refuses it; assigned inf: the Trajectory refuses the sum
        assert [t.status for t in g.trajectories] == ["failed", "failed"]
        assert all(t.error.startswith("ValidationError") and "must be finite, got" in t.error for t in g.trajectories)
    assert "reward must be finite, got nan" in groups[1].trajectories[0].error
    assert "must be finite, got inf" in groups[2].trajectories[0].error


def test_env_reward_plugins_weighted_async_trajectory_and_group(tmp_path):
    w = worker(tmp_path, ENV, rewards={"odd_nan": {"weight": 2.0}, "quarter": {"weight": 4.0}, "turns": {"weight": 0.01},
                                       "rank": {"weight": 0.5}})
    groups = asyncio.run(w.rollout([{"i": 0}, {"i": 1}, {"i": 2}], 3))
    # task 0: 0/4 + 2*1.0 + 4*0.25 + 0.01*(2 messages*10 + 1 turn) + 0.5*rank(0, 1, 2)
    assert [t.reward for t in groups[0].trajectories] == pytest.approx([3.21, 3.71, 4.21], abs=1e-12)
    assert groups[0].trajectories[0].info["rewards"] == {"odd_nan": 1.0, "quarter": 0.25, "turns": 21.0, "rank": 0.0}
    assert [t.error for t in groups[1].trajectories] == [
        "reward odd_nan: failed: non_finite (reward odd_nan returned nan; a reward must be a finite number)"] * 3
    assert [t.reward for t in groups[2].trajectories] == pytest.approx([3.71, 4.21, 4.71], abs=1e-12)
    _, m = assemble_batch(groups, False, ["odd_nan", "quarter", "turns", "rank"])
    assert m["rollout/failed"] == 3.0
    assert m["reward/odd_nan/failed"] == 3.0 and m["reward/odd_nan/mean"] == 1.0
    assert m["reward/quarter/failed"] == 0.0 and m["reward/quarter/mean"] == 0.25
    assert m["reward/rank/mean"] == 1.0 and m["reward/turns/mean"] == 21.0


def test_hanging_reward_times_out_and_the_rollout_goes_on(tmp_path):
    w = worker(tmp_path, ENV, rewards={"hang": {"timeout_s": 0.3}}, timeout_s=5.0)
    t0 = time.monotonic()
    groups = asyncio.run(w.rollout([{"i": 0}], 2))
    assert time.monotonic() - t0 < 8.0  # not the 20 s the reward sleeps
    assert [t.error for t in groups[0].trajectories] == [
        "reward hang: failed: timeout (no score within 0.3 s (rewards.hang.timeout_s))"] * 2


def test_chat_agent_non_finite_or_non_result_fails(tmp_path):
    w = worker(tmp_path, CHAT, rewards={"turns": {}})
    try:
        groups = asyncio.run(w.rollout([{"kind": "ok"}, {"kind": "nan"}, {"kind": "float"}], 2))
        # 0.5 + turns: the session's messages (user, assistant) -> 2 * 10 + 1 turn
        assert [t.reward for t in groups[0].trajectories] == [21.5, 21.5]
        assert [t.error for t in groups[1].trajectories] == [
            "agent Chat: failed: non_finite (agent Chat Result.reward returned nan; a reward must be a finite number)"] * 2
        assert [t.error for t in groups[2].trajectories] == [
            "TypeError: Chat.run returned float; return a molt_core.types.Result"] * 2
    finally:
        w.server.stop()


def test_eval_path_counts_non_finite_rewards_as_failed(tmp_path):
    w = worker(tmp_path, ENV, rewards={"odd_nan": {}})
    m = asyncio.run(w.evaluate([{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}], k=2, temperature=1.0))
    # tasks 1 (plugin NaN) and 3 (Result NaN) fail; 0 -> 0 + 1, 2 -> 0.5 + 1
    assert m["eval/failed"] == 4.0
    assert m["eval/reward"] == pytest.approx((1.0 + 1.0 + 1.5 + 1.5) / 4, abs=1e-12)
    assert not math.isnan(m["eval/pass@1"])
