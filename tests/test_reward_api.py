"""Reward API v2 (molt_core/rewards.py) and issue 11 items 3 and 4: non-finite rewards fail
their trajectory, every reward call is bounded, async / group / trajectory rewards, weights
and per-component metrics. Exact values throughout."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from molt_core.rewards import Rollout, as_score, group_reward, judge_endpoint, reward_spec
from molt_core.rollout.scoring import component_metrics, score_group
from molt_core.types import Group, RewardFailed, Segment, Trajectory
from molt_plugins.rewards.base import RewardOptions, check_options, reward

TASK = {"question": "q", "answer": "4"}


def traj(reward=0.0, score=None):
    seg = Segment(token_ids=[1, 2], loss_mask=[False, True], logprobs=[None, -0.5], versions=[None, 0])
    t = Trajectory(segments=[seg], reward=0.0, task=TASK)
    # the ChatAgent path copies Result.reward in with model_copy, which does not validate
    return t.model_copy(update={"reward": reward, "score": score})


def items(*responses, reward=0.0):
    out = []
    for r in responses:
        t = traj(reward)
        out.append((t, Rollout(response=r, task=TASK, messages=[{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": r}], trajectory=t)))
    return out


def score(specs, its, limit=16, **kw):
    async def go():
        return await score_group(specs, its, asyncio.Semaphore(limit), **kw)

    return asyncio.run(go())


def spec(name, fn, **table):
    return reward_spec(name, fn, table)


# -- item 3: non-finite and non-number rewards ----------------------------------------------
@pytest.mark.parametrize("value,error", [
    (float("nan"), "reward bad: failed: non_finite (reward bad returned nan; a reward must be a finite number)"),
    (float("inf"), "reward bad: failed: non_finite (reward bad returned inf; a reward must be a finite number)"),
    (-float("inf"), "reward bad: failed: non_finite (reward bad returned -inf; a reward must be a finite number)"),
    (np.float32("nan"), "reward bad: failed: non_finite (reward bad returned nan; a reward must be a finite number)"),
    (np.float64("inf"), "reward bad: failed: non_finite (reward bad returned inf; a reward must be a finite number)"),
    (None, "reward bad: failed: not_a_number (reward bad returned NoneType None; return a finite float)"),
    ("0.5", "reward bad: failed: not_a_number (reward bad returned str '0.5'; return a finite float)"),
    ([1.0], "reward bad: failed: not_a_number (reward bad returned list [1.0]; return a finite float)"),
])
def test_non_finite_or_non_number_reward_fails_its_trajectory(value, error):
    out = score([spec("bad", lambda response, task: value)], items("a"))
    assert out[0].status == "failed" and out[0].reward is None
    assert out[0].error == error
    assert out[0].info["rewards_failed"] == ["bad"]


def test_the_same_reward_async_and_the_eval_like_path_fail_the_same_way():
    async def bad(response, task):
        return float("nan")

    out = score([spec("bad", bad)], items("a", "b"))
    assert [t.error for t in out] == ["reward bad: failed: non_finite (reward bad returned nan; a reward must be a finite number)"] * 2


@pytest.mark.parametrize("value", [np.float64(0.25), np.int64(3), True, 2])
def test_real_numbers_of_any_type_are_accepted(value):
    out = score([spec("ok", lambda response, task: value)], items("a"))
    assert out[0].status == "ok" and out[0].reward == float(value)


@pytest.mark.parametrize("field,value,error", [
    ("reward", float("nan"), "agent Chat: failed: non_finite (agent Chat Result.reward returned nan; a reward must be a finite number)"),
    ("reward", float("-inf"), "agent Chat: failed: non_finite (agent Chat Result.reward returned -inf; a reward must be a finite number)"),
    ("reward", "1", "agent Chat: failed: not_a_number (agent Chat Result.reward returned str '1'; return a finite float)"),
    ("score", float("nan"), "agent Chat: failed: non_finite (agent Chat Result.score returned nan; a reward must be a finite number)"),
])
def test_agent_own_reward_or_score_non_finite_fails(field, value, error):
    t = traj(0.0).model_copy(update={field: value})
    out = score([], [(t, Rollout(response="a", task=TASK, trajectory=t))], agent_label="agent Chat")
    assert out[0].status == "failed" and out[0].error == error


def test_decorated_reward_returning_nan_fails():
    @reward(RewardOptions)
    def nanny(response, task, opts):
        return float("nan")

    out = score([spec("nanny", nanny)], items("a"))
    assert out[0].error == "reward nanny: failed: non_finite (reward nanny returned nan; a reward must be a finite number)"


def test_as_score_exact():
    assert as_score(np.float32(0.5), "x") == 0.5
    with pytest.raises(RewardFailed) as ei:
        as_score(float("nan"), "x")
    assert ei.value.reason == "non_finite"


# -- weights, components, metrics ---------------------------------------------------------
def test_weighted_sum_and_components():
    specs = [spec("a", lambda response, task: 1.0, weight=2.0), spec("b", lambda response, task: 0.25, weight=0.5)]
    out = score(specs, items("x", reward=0.5))
    # 0.5 (the agent's Result.reward) + 2.0 * 1.0 + 0.5 * 0.25
    assert out[0].reward == 2.625
    assert out[0].info["rewards"] == {"a": 1.0, "b": 0.25}


def test_first_failing_reward_in_recipe_order_names_the_error_and_all_are_counted():
    def boom(response, task):
        raise RewardFailed("crash", "verifier died")

    specs = [spec("ok", lambda response, task: 1.0), spec("boom", boom), spec("nan", lambda response, task: math.nan)]
    out = score(specs, items("x"))
    assert out[0].error == "reward boom: failed: crash (verifier died)"
    assert out[0].info["rewards_failed"] == ["boom", "nan"]
    assert out[0].info["rewards"] == {"ok": 1.0}


def test_component_metrics_exact():
    ok1 = traj(1.0).model_copy(update={"info": {"rewards": {"a": 1.0, "b": 0.5}}})
    ok2 = traj(1.0).model_copy(update={"info": {"rewards": {"a": 0.0, "b": 0.25}}})
    bad = traj(1.0).model_copy(update={"info": {"rewards": {"a": 1.0}, "rewards_failed": ["b"]}}).fail("reward b: x")
    m = component_metrics([Group(trajectories=[ok1, ok2, bad])], ["a", "b", "c"])
    assert m["reward/a/mean"] == 0.5 and m["reward/b/mean"] == 0.375
    assert m["reward/a/failed"] == 0.0 and m["reward/b/failed"] == 1.0 and m["reward/c/failed"] == 0.0
    assert math.isnan(m["reward/c/mean"])


# -- reserved keys ------------------------------------------------------------------------
def test_reserved_keys_are_split_from_options():
    s = spec("exact_match", lambda response, task, **o: 1.0, weight=0.5, timeout_s=3, strip=False)
    assert (s.weight, s.timeout_s, s.options) == (0.5, 3.0, {"strip": False})
    from molt_plugins.judges.llm_judge import llm_judge

    j = spec("llm_judge", llm_judge, weight=2, timeout_s=30.0, base_url="http://x/v1")
    # llm_judge declares timeout_s (its own deadline): it also receives it; never weight. The
    # runtime's bound is that deadline + 2 s, so the judge's own verdict comes first
    assert (j.weight, j.timeout_s, j.options) == (2.0, 32.0, {"timeout_s": 30.0, "base_url": "http://x/v1"})
    assert (j.group, j.judge_session, j.isolation) == (False, False, "thread")
    g = spec("llm_judge", llm_judge, mode="group")
    assert (g.group, g.judge_session, g.timeout_s, g.weight) == (True, True, 62.0, 1.0)


@pytest.mark.parametrize("table,error", [
    ({"weight": "high"}, r"rewards.r.weight = 'high': must be a finite number"),
    ({"weight": float("nan")}, r"rewards.r.weight = nan: must be a finite number"),
    ({"timeout_s": 0}, r"rewards.r.timeout_s = 0: must be a positive number of seconds"),
    ({"timeout_s": float("inf")}, r"rewards.r.timeout_s = inf: must be a positive number of seconds"),
])
def test_bad_reserved_keys_name_the_field(table, error):
    with pytest.raises(ValueError, match=error):
        spec("r", lambda response, task: 1.0, **table)


def test_check_options_accepts_reserved_keys():
    from molt_plugins.rewards.basic import exact_match

    check_options("exact_match", exact_match, {"strip": True, "weight": 0.5, "timeout_s": 5})
    with pytest.raises(ValueError, match="rewards.exact_match.weight"):
        check_options("exact_match", exact_match, {"weight": "x"})


# -- item 4: every call bounded -----------------------------------------------------------
def test_sync_reward_past_its_timeout_fails_and_the_step_does_not_wait():
    release = threading.Event()

    def hang(response, task):
        release.wait(30)  # a sync reward cannot be killed: the step just stops waiting
        return 1.0

    t0 = time.monotonic()
    out = score([spec("hang", hang, timeout_s=0.2), spec("fine", lambda response, task: 1.0)], items("a", "b"))
    elapsed = time.monotonic() - t0
    release.set()
    assert [t.error for t in out] == ["reward hang: failed: timeout (no score within 0.2 s (rewards.hang.timeout_s))"] * 2
    assert elapsed < 2.0


def test_async_reward_past_its_timeout_is_cancelled():
    cancelled = []

    async def slow(response, task):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(response)
            raise
        return 1.0

    out = score([spec("slow", slow, timeout_s=0.1)], items("a", "b"))
    assert [t.error for t in out] == ["reward slow: failed: timeout (no score within 0.1 s (rewards.slow.timeout_s))"] * 2
    # each call runs on its own loop in its own thread: the cancel is delivered there, at once
    # but asynchronously (the step does not wait for the reward to acknowledge it)
    t0 = time.monotonic()
    while len(cancelled) < 2 and time.monotonic() - t0 < 2.0:
        time.sleep(0.01)
    assert sorted(cancelled) == ["a", "b"] and time.monotonic() - t0 < 0.5


def test_a_timed_out_reward_releases_its_slot():
    def hang(response, task):
        time.sleep(5)

    # one slot: the hung call's slot is released at its deadline, so the next call runs
    out = score([spec("hang", hang, timeout_s=0.2), spec("one", lambda response, task: 1.0)], items("a"), limit=1)
    assert out[0].error.startswith("reward hang: failed: timeout")


# -- async and concurrency -----------------------------------------------------------------
def test_async_reward_is_awaited():
    async def half(response, task):
        await asyncio.sleep(0)
        return 0.5

    out = score([spec("half", half, weight=3.0)], items("a"))
    assert out[0].status == "ok" and out[0].reward == 1.5


@pytest.mark.parametrize("limit,expected", [(2, 2), (8, 6)])
def test_reward_calls_run_concurrently_up_to_the_limit(limit, expected):
    state = {"now": 0, "max": 0}

    async def busy(response, task):
        state["now"] += 1
        state["max"] = max(state["max"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return 1.0

    out = score([spec("busy", busy)], items(*"abcdef"), limit=limit)
    assert [t.reward for t in out] == [1.0] * 6 and state["max"] == expected


# -- group and trajectory rewards ---------------------------------------------------------
def test_group_reward_scores_the_ok_rollouts_of_a_group_at_once():
    seen = []

    @group_reward
    def by_length(responses, tasks):
        seen.append((list(responses), len(tasks)))
        return [len(r) / 4 for r in responses]

    its = items("a", "abcd", "ab")
    its.insert(1, (traj(0.0).fail("agent crashed"), None))
    out = score([spec("len", by_length, weight=2.0)], its)
    assert seen == [(["a", "abcd", "ab"], 3)]
    assert [t.reward for t in out] == [0.5, None, 2.0, 1.0]
    assert out[1].error == "agent crashed"


def test_group_reward_with_the_wrong_count_fails_the_group():
    out = score([spec("g", group_reward(lambda responses, tasks: [1.0]))], items("a", "b"))
    assert [t.error for t in out] == ["reward g: failed: bad_output (a group reward must return a list of one score "
                                      "per response: 2 responses, got 1 scores)"] * 2


def test_decorated_async_group_reward_with_trajectories():
    @reward(RewardOptions, group=True)
    async def turns(responses, tasks, opts, trajectories):
        return [r.turns + len(r.tool_calls) for r in trajectories]

    s = spec("turns", turns)
    assert (s.group, s.trajectory, s.is_async) == (True, True, True)
    its = items("a", "b")
    its[1][1].messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}, {"id": "c2"}]})
    out = score([s], its)
    assert [t.reward for t in out] == [1.0, 4.0]


def test_trajectory_reward_gets_the_whole_rollout():
    got = []

    def whole(response, task, trajectory):
        got.append(trajectory)
        return float(trajectory.turns)

    out = score([spec("whole", whole)], items("hi"))
    assert out[0].reward == 1.0
    assert got[0].messages[-1] == {"role": "assistant", "content": "hi"} and got[0].trajectory.num_sampled == 1


def test_judge_endpoint_is_set_only_inside_a_judge_call():
    seen = []
    closed = []

    def judge(response, task):
        seen.append(judge_endpoint())
        return 1.0

    judge.molt_judge_session = True
    from molt_core.rewards import JudgeEndpoint

    n = iter(range(10))

    def open_session():
        i = next(n)
        return JudgeEndpoint(f"http://s{i}/v1", f"k{i}"), lambda: closed.append(i)

    out = score([spec("j", judge)], items("a", "b"), open_session=open_session)
    assert [t.reward for t in out] == [1.0, 1.0]
    assert sorted(e.base_url for e in seen) == ["http://s0/v1", "http://s1/v1"] and sorted(closed) == [0, 1]
    assert judge_endpoint() is None


def test_check_rewards_validates_reserved_keys_before_compute():
    from molt_core.config import RunConfig
    from molt_core.plugins import load_plugins
    from molt_core.runtime import check_rewards

    host = load_plugins()
    check_rewards(RunConfig.model_validate({"rewards": {"regex": {"pattern": "x", "weight": 0.5, "timeout_s": 2}}}), host)
    with pytest.raises(ValueError, match=r"rewards.regex.weight = 'hi': must be a finite number"):
        check_rewards(RunConfig.model_validate({"rewards": {"regex": {"pattern": "x", "weight": "hi"}}}), host)
    with pytest.raises(ValueError, match=r"rewards.regex.patern: Extra inputs are not permitted"):
        check_rewards(RunConfig.model_validate({"rewards": {"regex": {"pattern": "x", "patern": "y", "weight": 1}}}), host)


# -- review 11: every form of a reward that cannot finish is bounded, and never stalls the loop --

def gil_hog(response, task):
    """One C call holding the GIL for minutes (a 1.2e9-bit integer power)."""
    return float(9 ** (9 ** 9) > 0)


def proc_boom(response, task):
    raise ValueError("boom")


def proc_nan(response, task):
    return float("nan")


def proc_pid(response, task):
    import os

    return float(os.getpid())


def _timed_with_ticks(coro_fn):
    """Run ``coro_fn()`` while a ticker sleeps 10 ms at a time; (result, elapsed s, ticks)."""
    async def go():
        ticks = 0
        stop = False

        async def ticker():
            nonlocal ticks
            while not stop:
                await asyncio.sleep(0.01)
                ticks += 1

        tk = asyncio.create_task(ticker())
        t0 = time.monotonic()
        out = await coro_fn()
        elapsed = time.monotonic() - t0
        stop = True
        await tk
        return out, elapsed, ticks

    return asyncio.run(go())


def test_process_reward_holding_the_gil_is_killed_at_its_deadline_and_the_loop_runs():
    from molt_core.rollout import scoring as R

    s = spec("hog", gil_hog, timeout_s=1.0, isolation="process")
    assert (s.isolation, s.timeout_s) == ("process", 1.0)
    out, elapsed, ticks = _timed_with_ticks(lambda: score_group([s], items("a"), asyncio.Semaphore(4)))
    assert out[0].error == "reward hog: failed: timeout (no score within 1 s (rewards.hog.timeout_s))"
    # worker start (importing this module) is outside the deadline; the loop kept ticking throughout
    assert elapsed < 15.0 and ticks >= 0.5 * elapsed / 0.01
    assert R._POOLS.get(id(gil_hog), (gil_hog, []))[1] == []  # the killed worker is gone, not reused


def test_math_answer_runs_in_a_killed_process_whatever_sympy_does():
    from molt_core.rollout.scoring import RewardRunner
    from molt_plugins.rewards.math_answer import math_answer

    s = reward_spec("math_answer", math_answer, {"timeout_s": 2})
    assert (s.isolation, s.timeout_s, s.options) == ("process", 3.0, {"timeout_s": 2})
    rr = RewardRunner({"math_answer": {"timeout_s": 2}}, lambda n: math_answer, 4)
    task = {"answer": "5"}
    its = [(traj(), Rollout(response=r"so \boxed{9^{9^{9^{9}}}}", task=task)),
           (traj(), Rollout(response=r"so \boxed{5}", task=task))]
    out, elapsed, ticks = _timed_with_ticks(lambda: rr.score(its))
    assert out[0].status == "failed" and out[0].error.startswith("reward math_answer: failed: timeout (")
    assert (out[1].status, out[1].reward) == ("ok", 1.0)
    assert elapsed < 30.0 and ticks >= 0.5 * elapsed / 0.01


def test_regex_backtracking_is_killed_at_its_deadline():
    from molt_plugins.rewards.basic import regex

    s = reward_spec("regex", regex, {"pattern": "^(a+)+$", "timeout_s": 1.0})
    assert s.isolation == "process"
    out, elapsed, ticks = _timed_with_ticks(lambda: score_group([s], items("a" * 40 + "b"), asyncio.Semaphore(4)))
    assert out[0].error == "reward regex: failed: timeout (no score within 1 s (rewards.regex.timeout_s))"
    assert ticks >= 0.5 * elapsed / 0.01


def test_process_rewards_report_like_thread_ones_and_reuse_their_worker():
    out = score([spec("boom", proc_boom, isolation="process"), spec("nan", proc_nan, isolation="process")], items("a"))
    assert out[0].error == "reward boom raised ValueError: boom"
    assert out[0].info["rewards_failed"] == ["boom", "nan"]
    lam = spec("lam", lambda response, task: 0.25, isolation="process")  # by value (cloudpickle)
    assert [t.reward for t in score([lam], items("a", "b"))] == [0.25, 0.25]
    s = spec("pid", proc_pid, isolation="process")
    first = score([s], items("a"), limit=1)[0].reward
    assert score([s], items("a"), limit=1)[0].reward == first  # the same live worker served both calls


def test_bad_isolation_is_refused_at_spec_time():
    with pytest.raises(ValueError, match=r"rewards.r.isolation = 'fork': must be 'thread' or 'process'"):
        spec("r", proc_nan, isolation="fork")

    def judge(response, task):
        return 1.0

    judge.molt_judge_session = True
    with pytest.raises(ValueError, match=r"rewards.j.isolation = 'process': this reward asks the run's own engine"):
        spec("j", judge, isolation="process")


def test_blocking_async_reward_times_out_at_its_deadline_without_stalling_the_loop():
    async def blocks(response, task):
        time.sleep(3)  # blocks whatever loop it runs on
        return 1.0

    s = spec("a", blocks, timeout_s=0.5)
    out, elapsed, ticks = _timed_with_ticks(lambda: score_group([s], items("x", "y"), asyncio.Semaphore(4)))
    assert [t.error for t in out] == ["reward a: failed: timeout (no score within 0.5 s (rewards.a.timeout_s))"] * 2
    assert 0.5 <= elapsed < 1.0 and ticks >= 25


def test_async_reward_that_swallows_cancellation_still_fails_at_its_deadline():
    async def stubborn(response, task):
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    def returns_coroutine(response, task):  # a sync callable handing back a blocking awaitable
        async def inner():
            time.sleep(3)
            return 1.0
        return inner()

    t0 = time.monotonic()
    out = score([spec("s", stubborn, timeout_s=0.3), spec("c", returns_coroutine, timeout_s=0.3)], items("x"))
    assert out[0].info["rewards_failed"] == ["s", "c"]
    assert out[0].error == "reward s: failed: timeout (no score within 0.3 s (rewards.s.timeout_s))"
    assert time.monotonic() - t0 < 1.0


def test_code_tests_through_the_runner_is_bounded_by_the_sandbox_not_before_it():
    from molt_plugins.rewards.code import code_tests

    task = {"tests": "assert add(2, 3) == 5\n"}

    def run(table, code):
        s = reward_spec("code_tests", code_tests, table)
        its = [(traj(), Rollout(response="```python\n" + code + "```", task=task))]
        return score([s], its)[0]

    slow_right = "import time\ntime.sleep(0.5)\ndef add(a, b):\n    return a + b\n"
    loop = "def add(a, b):\n    while True:\n        pass\n"
    r = run({"timeout_s": 1.0}, slow_right)
    assert (r.status, r.reward) == ("ok", 1.0)
    r = run({"timeout_s": 1.0}, loop)  # default limit_exceeded = "zero"
    assert (r.status, r.reward, r.info["rewards"]) == ("ok", 0.0, {"code_tests": 0.0})
    r = run({"timeout_s": 1.0, "limit_exceeded": "zero"}, loop)
    assert (r.status, r.reward) == ("ok", 0.0)
    r = run({"timeout_s": 1.0, "limit_exceeded": "fail"}, loop)
    assert r.status == "failed" and r.error.startswith("reward code_tests: failed: timeout (timeout (exit -9, 1.")


# -- review 11: group outputs and decorated rewards ------------------------------------------

def test_one_bad_score_of_a_group_fails_only_its_rollout():
    out = score([spec("g", group_reward(lambda responses, tasks: [1.0, float("nan"), 0.5]))], items("a", "b", "c"))
    assert [(t.status, t.reward) for t in out] == [("ok", 1.0), ("failed", None), ("ok", 0.5)]
    assert out[1].error == "reward g: failed: non_finite (reward g returned nan; a reward must be a finite number)"
    out = score([spec("g", group_reward(lambda responses, tasks: (None, 0.25, "0.5")))], items("a", "b", "c"))
    assert [(t.status, t.reward) for t in out] == [("failed", None), ("ok", 0.25), ("failed", None)]
    assert out[0].error == "reward g: failed: not_a_number (reward g returned NoneType None; return a finite float)"
    assert out[2].error == "reward g: failed: not_a_number (reward g returned str '0.5'; return a finite float)"


@pytest.mark.parametrize("value,got", [
    ({0: 1.0, 1: 2.0}, "dict"),
    ({1.0, 2.0}, "set"),
    ((x for x in [1.0, 2.0]), "generator"),
    ("ab", "str"),
    (np.array([[1.0], [2.0]]), "an array of shape (2, 1)"),
    (np.float64(1.0), "an array of shape ()"),
    ([1.0, 2.0, 3.0], "3 scores"),
])
def test_group_output_that_is_not_a_list_of_scores_is_bad_output(value, got):
    out = score([spec("g", group_reward(lambda responses, tasks: value))], items("a", "b"))
    assert [t.error for t in out] == [f"reward g: failed: bad_output (a group reward must return a list of one score "
                                      f"per response: 2 responses, got {got})"] * 2


def test_group_output_as_tuple_or_1d_array():
    import torch

    for value in ((0.5, 1.0), np.array([0.5, 1.0]), torch.tensor([0.5, 1.0])):
        out = score([spec("g", group_reward(lambda responses, tasks, v=value: v))], items("a", "b"))
        assert [t.reward for t in out] == [0.5, 1.0]


def test_decorated_reward_returns_unconverted_and_the_runtime_judges_it():
    @reward(RewardOptions)
    def as_text(response, task, opts):
        return "0.75"

    @reward(RewardOptions)
    def nothing(response, task, opts):
        return None

    @reward(RewardOptions, group=True)
    def keyed(responses, tasks, opts):
        return {0: 1.0, 1: 0.0}

    @reward(RewardOptions)
    def huge(response, task, opts):
        return 10 ** 400

    assert as_text("r", {}) == "0.75" and nothing("r", {}) is None
    out = score([spec("as_text", as_text)], items("a"))
    assert out[0].error == "reward as_text: failed: not_a_number (reward as_text returned str '0.75'; return a finite float)"
    out = score([spec("nothing", nothing)], items("a"))
    assert out[0].error == "reward nothing: failed: not_a_number (reward nothing returned NoneType None; return a finite float)"
    out = score([spec("keyed", keyed)], items("a", "b"))
    assert [t.error for t in out] == ["reward keyed: failed: bad_output (a group reward must return a list of one score "
                                      "per response: 2 responses, got dict)"] * 2
    out = score([spec("huge", huge)], items("a"))
    assert out[0].error == "reward huge: failed: non_finite (reward huge returned int beyond the float range)"


def proc_dies(response, task):
    import os

    os._exit(3)


def test_a_reward_process_that_dies_fails_crash_and_is_replaced():
    s = spec("dies", proc_dies, isolation="process")
    out = score([s], items("a"))
    assert out[0].error == "reward dies: failed: crash (the reward process died (exit 3))"
    out = score([s], items("b"))  # a fresh worker, same verdict
    assert out[0].error == "reward dies: failed: crash (the reward process died (exit 3))"


@reward(RewardOptions, isolation="process")
def decorated_in_process(response, task, opts):
    import os

    return 1.0 if os.getpid() != task["parent"] else 0.0


def test_reward_decorator_sets_the_default_isolation():
    import os

    s = spec("d", decorated_in_process)
    assert s.isolation == "process" and spec("d", decorated_in_process, isolation="thread").isolation == "thread"
    its = [(traj(), Rollout(response="a", task={"parent": os.getpid()}))]
    assert score([s], its)[0].reward == 1.0  # it ran in another process
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process', got 'fork'"):
        reward(RewardOptions, isolation="fork")(lambda response, task, opts: 1.0)


def proc_quarter(response, task):
    return 0.25


def test_reward_process_never_outlives_the_thread_that_started_it():
    from molt_core.rollout import scoring as R

    s = spec("q", proc_quarter, isolation="process")
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("out", score([s], items("a"))))
    th.start()
    th.join(60)
    assert box["out"][0].reward == 0.25
    workers = list(R._POOLS[id(proc_quarter)][1])
    assert len(workers) == 1  # idle in the pool ...
    t0 = time.monotonic()
    while workers[0].alive() and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert not workers[0].alive() and workers[0].proc.returncode == -9  # ... killed with its thread (PDEATHSIG)
    assert score([s], items("b"))[0].reward == 0.25  # a dead idle worker is replaced, not used
