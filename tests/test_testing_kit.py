"""molt_core.testing: the public kit plugin authors test with (issue 15, item 1)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from molt_core.agents import ChatAgent, Env
from molt_core.rewards import group_reward
from molt_core.types import Result, RewardFailed, SamplingParams
from molt_core.testing import (RewardCallFailed, ScriptedEngine, loopback_server, run_episode, score_reward,
                               tiny_engine, tiny_tokenizer)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_testing_imports_no_plugin():
    code = "import sys, molt_core.testing; print(sorted(m for m in sys.modules if m.startswith('molt_plugins')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_scripted_engine_exact_ids_logprobs_versions(tok):
    eng = ScriptedEngine(tok, ["Hi.", [5, 6, 7, 8]])
    p = SamplingParams(max_tokens=3)
    a = asyncio.run(eng.generate([1, 2], p.model_copy(update={"max_tokens": 4})))  # "Hi." is 3 ids, then the stop id
    assert a.token_ids == tok.encode("Hi.", add_special_tokens=False) + [tok.eos_token_id]
    assert a.finish_reason == "stop" and a.prompt_len == 2
    assert a.logprobs == [-0.1 - j / 1000 for j in range(len(a.token_ids))]
    eng.load_weights({}, 3)
    b = asyncio.run(eng.generate([1], p))
    assert b.token_ids == [5, 6, 7] and b.finish_reason == "length"
    assert b.logprobs == [-0.2, -0.201, -0.202] and b.versions == [3, 3, 3]
    assert eng.prompts == [[1, 2], [1]] and eng.calls == 2


def test_scripted_engine_never_samples_past_max_tokens(tok):
    """Issue 24 item 7: a text reply whose stop id (or stop string) lies past ``max_tokens`` is cut
    there with finish ``length``, as a real engine's would be (it used to come back whole, ``stop``)."""
    eng = ScriptedEngine(tok, ["Hi.", "Hi.", "Hi."])
    cut = asyncio.run(eng.generate([1], SamplingParams(max_tokens=3)))
    assert (cut.token_ids, cut.finish_reason, cut.stop_reason) == ([48, 81, 22], "length", None)
    assert cut.logprobs == [-0.1 - j / 1000 for j in range(3)]  # call 0: -(0 + 1) / 10 - j / 1000
    short = asyncio.run(eng.generate([1], SamplingParams(max_tokens=2, stop=["."])))  # "." is the third id
    assert (short.token_ids, short.finish_reason) == ([48, 81], "length")
    whole = asyncio.run(eng.generate([1], SamplingParams(max_tokens=4)))
    assert (whole.token_ids, whole.finish_reason, whole.stop_reason) == ([48, 81, 22, 2], "stop", 2)


def test_tests_fake_engine_reexports_the_public_one():
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_engine

    assert fake_engine.ScriptedEngine is ScriptedEngine


class Count(Env):
    """Two turns: 0.25 then 0.5 (score 1.0)."""

    def reset(self, task):
        return f"count to {task['n']}"

    def step(self, action_text, state):
        state.scratch.setdefault("seen", []).append(action_text)
        if state.turn < 1:
            return Result(reward=0.25, observation="more")
        return Result(reward=0.5, score=1.0, terminated=True, info={"seen": state.scratch["seen"]})


def test_run_episode_env_scripted_policy_and_rewards(tok):
    def brevity(response, task, max_chars=2):
        return min(1.0, max_chars / len(response))

    g = run_episode(Count(), {"n": 2}, ["one", "two2"], rewards={"brevity": {"max_chars": 2, "weight": 2.0}},
                    reward_lookup={"brevity": brevity}.__getitem__)
    (t,) = g.trajectories
    assert t.status == "ok" and t.info["seen"] == ["one", "two2"]
    assert t.info["rewards"] == {"brevity": 0.5}             # the final reply "two2": 2 / 4
    assert t.reward == 0.25 + 0.5 + 2.0 * 0.5 and t.score == 1.0
    seg = t.segments[0]
    sampled = [i for i, m in enumerate(seg.loss_mask) if m]
    assert [seg.token_ids[i] for i in sampled] == (tok.encode("one", add_special_tokens=False) + [tok.eos_token_id]
                                                   + tok.encode("two2", add_special_tokens=False) + [tok.eos_token_id])
    n2 = len(tok.encode("two2", add_special_tokens=False)) + 1   # call 1: -(1 + 1) / 10 - j / 1000
    assert seg.logprobs[sampled[0]] == -0.1 and seg.logprobs[sampled[-1]] == -0.2 - (n2 - 1) / 1000


def test_run_episode_env_that_raises_fails_the_rollout():
    class Boom(Env):
        def reset(self, task):
            return "x"

        def step(self, action_text, state):
            raise RuntimeError("bad grader")

    (t,) = run_episode(Boom(), {}, ["a"]).trajectories
    assert t.status == "failed" and t.error == "RuntimeError: bad grader"


class Ask(ChatAgent):
    """One OpenAI request; reward 1.0 iff the reply equals the task's answer."""

    async def run(self, ctx):
        import openai

        c = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        r = await c.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": ctx.task["q"]}],
                                            max_tokens=16)
        text = r.choices[0].message.content
        return Result(reward=float(text == ctx.task["a"]), info={"said": text})


def test_run_episode_chat_agent_through_the_loopback_server(tok):
    g = run_episode(Ask(), {"q": "2+2?", "a": "4"}, ["4", "5"], n=2)
    said = sorted((t.info["said"], t.reward) for t in g.trajectories)
    assert said == [("4", 1.0), ("5", 0.0)]
    for t in g.trajectories:
        seg = t.segments[0]
        assert seg.token_ids[-2:] == tok.encode(t.info["said"], add_special_tokens=False) + [tok.eos_token_id]


def test_loopback_server_context_serves_and_stops(tok):
    import openai

    eng = ScriptedEngine(tok, ["Hello."])
    with loopback_server(eng) as h:
        s = h.create_session()
        r = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key, max_retries=0).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "Hello."
        traj = h.close_session(s.session_id)
        assert traj.num_sampled == len(tok.encode("Hello.", add_special_tokens=False)) + 1
    assert h.running is False


def test_run_episode_with_the_tiny_real_engine():
    g = run_episode(Count(), {"n": 1}, engine=tiny_engine(), max_tokens=3)
    (t,) = g.trajectories
    assert t.status == "ok" and t.reward == 0.75 and t.num_sampled <= 6
    assert all(lp is not None and lp <= 0 for s in t.segments for lp, m in zip(s.logprobs, s.loss_mask) if m)


# ------------------------------------------------------------------ reward harness
def test_score_reward_sync_async_group_trajectory():
    def exact(response, task):
        return float(response.strip() == task["answer"])

    async def turns(response, task, trajectory, bonus=0.0):
        return trajectory.turns + bonus

    @group_reward
    def rank(responses, tasks):
        order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
        return [1.0 - order.index(i) / len(responses) for i in range(len(responses))]

    assert score_reward(exact, " 42\n", {"answer": "42"}) == 1.0
    assert score_reward(exact, ["42", "41"], {"answer": "42"}) == [1.0, 0.0]
    assert score_reward(turns, "hi", bonus=0.5) == 1.5
    assert score_reward(rank, ["aaa", "a", "aa"]) == [1.0 - 2 / 3, 1.0, 1.0 - 1 / 3]
    assert score_reward(exact, "42", {"answer": "42"}, weight=0.5, timeout_s=5) == 1.0  # reserved keys not passed


@pytest.mark.parametrize("fn,error", [
    (lambda r, t: float("nan"), "reward bad: failed: non_finite (reward bad returned nan; a reward must be a finite number)"),
    (lambda r, t: None, "reward bad: failed: not_a_number (reward bad returned NoneType None; return a finite float)"),
    (lambda r, t: 1 / 0, "reward bad raised ZeroDivisionError: division by zero"),
    (lambda r, t: (_ for _ in ()).throw(RewardFailed("parse", "no score")), "reward bad: failed: parse (no score)"),
])
def test_score_reward_failures_read_as_the_run_records_them(fn, error):
    with pytest.raises(RewardCallFailed) as e:
        score_reward(fn, "x", name="bad")
    assert e.value.error == error


def test_score_reward_timeout_and_bad_group_output():
    async def slow(response, task):
        await asyncio.sleep(5)
        return 1.0

    with pytest.raises(RewardCallFailed, match=r"^reward slow: failed: timeout \(no score within 0\.05 s \(rewards\.slow\.timeout_s\)\)$"):
        score_reward(slow, "x", timeout_s=0.05)
    short = group_reward(lambda rs, ts: [1.0])
    with pytest.raises(RewardCallFailed, match=r"^reward short: failed: bad_output \(a group reward must return a list of one score per response: 2 responses, got 1 scores\)$"):
        score_reward(short, ["a", "b"], name="short")
    with pytest.raises(ValueError, match=r"rewards.x.weight = inf"):
        score_reward(lambda r, t: 1.0, "a", name="x", weight=math.inf)


def test_score_reward_by_installed_name():
    assert score_reward("exact_match", " 7\n", {"answer": "7"}) == 1.0
    assert score_reward("exact_match", "8", {"answer": "7"}) == 0.0


FIXTURE_TESTS = '''
import openai
from molt_core.testing import ScriptedEngine, run_episode


def test_fixtures(molt_tokenizer, molt_scripted_engine, molt_tiny_engine, molt_loopback, molt_run_episode,
                  molt_score_reward):
    eng = molt_scripted_engine(["Hi."])
    assert isinstance(eng, ScriptedEngine) and eng.tokenizer is molt_tokenizer
    s = molt_loopback(eng).create_session()
    r = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key, max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "Hi."
    s2 = molt_loopback(molt_tiny_engine).create_session()
    r2 = openai.OpenAI(base_url=s2.openai_base_url, api_key=s2.api_key, max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r2.usage.completion_tokens <= 3
    assert molt_score_reward(lambda response, task: len(response), "abc") == 3.0
    assert molt_run_episode is run_episode
'''


def test_pytest_fixtures_through_the_plugin(tmp_path):
    (tmp_path / "test_fx.py").write_text(FIXTURE_TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "molt_core.testing", "-p", "no:cacheprovider",
                        "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.splitlines()[-1].startswith("1 passed")
