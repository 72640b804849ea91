"""The ``reasoning_gym`` env: exact scores from the task's own verifier, held-out disjointness,
clear errors (refused / unknown task, bad config)."""

from __future__ import annotations

import itertools
import json
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from molt_core.agents import EpisodeState, make_agent
from molt_core.types import RewardFailed
from molt_plugins.envs.reasoning_gym import ReasoningGymEnv

ADD2 = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2, operators=["+"], allow_parentheses=False)


@pytest.fixture(scope="module")
def env() -> ReasoningGymEnv:
    return ReasoningGymEnv(task="basic_arithmetic", config=ADD2, prompt_template="What is {metadata[expression]}?",
                           size=3000, eval_size=256)


def _step(env, task, reply):
    return env.step(reply, EpisodeState(task=task))


def test_quickstart_prompt_and_answer_are_short_and_correct(env):
    tasks = list(itertools.islice(env.tasks("train", 0), 50)) + list(env.tasks("eval", 0))
    for t in tasks:
        m = re.fullmatch(r"What is (\d+) \+ (\d+)\?", t["question"])
        assert m, t["question"]
        a, b = int(m.group(1)), int(m.group(2))
        assert t["answer"] == str(a + b)  # the gold answer is the sum, checked independently
        assert env.reset(t) == t["question"]
        assert json.loads(json.dumps(t)) == t  # plain JSON


def test_exact_scores_on_known_answers(env):
    t = next(env.tasks("eval", 0))
    gold = t["answer"]
    assert _step(env, t, gold).reward == 1.0
    r = _step(env, t, gold + "<|im_end|>")  # the quickstart model's reply: bare number + end marker
    assert (r.reward, r.score, r.terminated) == (1.0, 1.0, True)
    assert _step(env, t, f"  {gold}\n").reward == 1.0
    assert _step(env, t, "").reward == 0.0
    assert _step(env, t, "x").reward == 0.0
    # reasoning-gym's default scorer: partial credit len(gold)/len(reply) when gold is a substring
    assert _step(env, t, "9" + gold).reward == pytest.approx(len(gold) / (len(gold) + 1), abs=1e-12)
    assert _step(env, t, gold + "00").reward == pytest.approx(len(gold) / (len(gold) + 2), abs=1e-12)


def test_binary_reward_keeps_raw_score():
    e = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, binary=True, size=10, eval_size=4)
    t = next(e.tasks("eval", 0))
    r = _step(e, t, t["answer"] + "0")
    assert r.reward == 0.0 and r.score == pytest.approx(len(t["answer"]) / (len(t["answer"]) + 1))
    assert _step(e, t, t["answer"]).reward == 1.0


def test_reward_weight_scales_reward_not_score():
    e = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, reward_weight=0.0, size=10, eval_size=4)
    t = next(e.tasks("eval", 0))
    r = _step(e, t, t["answer"])
    assert (r.reward, r.score) == (0.0, 1.0)
    e2 = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, reward_weight=0.5, size=10, eval_size=4)
    assert _step(e2, t, t["answer"]).reward == 0.5


def test_uses_the_tasks_own_score_answer():
    # chain_sum's verifier compares decimals: "+01,000.00" == "1000" (reasoning_gym/arithmetic/chain_sum.py)
    e = ReasoningGymEnv(task="chain_sum", size=10, eval_size=4)
    t = {"question": "State the final answer: 999 + 1 =", "answer": "1000", "metadata": {}}
    assert _step(e, t, "+01,000.00").reward == 1.0
    assert _step(e, t, "1001").reward == 0.0
    # basic_arithmetic uses the base (string) verifier: the same reply is not an exact match
    b = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, size=10, eval_size=4)
    assert _step(b, t, "+01,000.00").reward == 0.0


def test_score_survives_json_round_trip(env):
    t = json.loads(json.dumps(next(env.tasks("eval", 3))))
    assert _step(env, t, t["answer"]).reward == 1.0


def test_eval_is_disjoint_from_train(env):
    eval_q = [t["question"] for t in env.tasks("eval", 0)]
    assert len(eval_q) == 256
    # without the filter the two generator-seed ranges still share questions by chance
    raw_train = {env._task(0, 3000, i)["question"] for i in range(3000)}
    collisions = raw_train & set(eval_q)
    assert len(collisions) > 0
    one_epoch = list(itertools.islice(env.tasks("train", 0), 3000 - sum(
        1 for i in range(3000) if env._task(0, 3000, i)["question"] in set(eval_q))))
    assert not ({t["question"] for t in one_epoch} & set(eval_q))
    # the train iterator is endless and keeps skipping eval questions in later epochs
    more = list(itertools.islice(env.tasks("train", 0), 2 * 3000))
    assert not ({t["question"] for t in more} & set(eval_q))
    assert {t["rg"]["seed"] for t in more} == {0}
    assert {t["rg"]["seed"] for t in env.tasks("eval", 0)} == {1_000_000_007}


def test_seed_option_overrides_and_eval_is_deterministic():
    a = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, size=50, eval_size=8, seed=5)
    assert [t["question"] for t in a.tasks("eval", 0)] == [t["question"] for t in a.tasks("eval", 99)]
    b = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, size=50, eval_size=8)
    assert [t["question"] for t in b.tasks("eval", 5)] == [t["question"] for t in a.tasks("eval", 0)]


def test_gsm_symbolic_is_refused():
    with pytest.raises(ValueError, match=r"gsm_symbolic.*CC BY-NC-ND"):
        ReasoningGymEnv(task="gsm_symbolic")


def test_errors_name_the_field():
    with pytest.raises(ValueError, match=r"'basic_arithmetc' is not a reasoning-gym task; did you mean 'basic_arithmetic'"):
        ReasoningGymEnv(task="basic_arithmetc")
    with pytest.raises(ValueError, match=r"agent.options.config sets seed"):
        ReasoningGymEnv(task="basic_arithmetic", config={"seed": 3})
    with pytest.raises(ValueError, match=r"agent.options.config is invalid .*min_terms must be positive"):
        ReasoningGymEnv(task="basic_arithmetic", config={"min_terms": 0})
    with pytest.raises(ValueError, match=r"agent.options.config is invalid .*no_such_key"):
        ReasoningGymEnv(task="basic_arithmetic", config={"no_such_key": 1})
    with pytest.raises(ValueError, match=r"agent.options.eval_size"):
        ReasoningGymEnv(task="basic_arithmetic", eval_size=0)
    e = ReasoningGymEnv(task="basic_arithmetic", prompt_template="{metadata[nope]}", size=5, eval_size=2)
    with pytest.raises(ValueError, match=r"prompt_template .* missing field"):
        next(e.tasks("eval", 0))
    with pytest.raises(ValueError, match=r"split must be 'train' or 'eval'"):
        next(e.tasks("test", 0))


def test_answer_tag_and_system_prompt():
    e = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, answer_tag="answer", system_prompt="Be brief.",
                        size=10, eval_size=2)
    assert e.system_prompt == "Be brief."
    t = next(e.tasks("eval", 0))
    assert _step(e, t, f"thinking... <answer>{t['answer']}</answer>").reward == 1.0
    assert _step(e, t, t["answer"]).reward == 0.0  # no tag: nothing to score


def test_crashing_verifier_fails_the_reward(monkeypatch):
    e = ReasoningGymEnv(task="basic_arithmetic", config=ADD2, size=10, eval_size=2)
    t = next(e.tasks("eval", 0))
    ds = e._dataset(t["rg"]["seed"], t["rg"]["size"])
    monkeypatch.setattr(ds, "score_answer", lambda answer, entry: 1 / 0)
    with pytest.raises(RewardFailed) as ei:
        _step(e, t, "1")
    assert ei.value.reason == "crash" and "ZeroDivisionError" in str(ei.value)


def test_registered_through_the_entry_point():
    from molt_core.plugins import load_plugins

    host = load_plugins()
    cls = host.get("envs", "reasoning_gym")
    agent = make_agent(cls, {"task": "basic_arithmetic", "config": ADD2, "size": 5, "eval_size": 2})
    assert isinstance(agent, ReasoningGymEnv)
