"""The built-in ``arithmetic`` env: the quickstart's problems without reasoning-gym, equal to
reasoning-gym's ``basic_arithmetic`` item by item (where reasoning-gym is installed), scored the
same way, and usable when reasoning-gym is absent."""

from __future__ import annotations

import itertools
import re
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from molt_core.agents import EpisodeState
from molt_plugins.envs.arithmetic import AdditionProblems, ArithmeticConfig, ArithmeticEnv, default_score
from molt_plugins.envs.reasoning_gym import EVAL_SEED_OFFSET, ReasoningGymEnv

ROOT = Path(__file__).resolve().parent.parent


def _options(recipe: str) -> dict:
    return tomllib.loads((ROOT / "recipes" / f"{recipe}.toml").read_text())["agent"]["options"]


QUICKSTART = _options("quickstart")
#: every builtin recipe on the arithmetic env -> its [agent.options]
ARITHMETIC_RECIPES = {
    p.relative_to(ROOT / "recipes").with_suffix("").as_posix(): tomllib.loads(p.read_text())["agent"]["options"]
    for p in sorted((ROOT / "recipes").rglob("*.toml")) if tomllib.loads(p.read_text()).get("agent", {}).get("name") == "arithmetic"}
# every distinct configuration those recipes give (operators, terms, digits), by its first recipe
CONFIGS = {}
for _name, _o in ARITHMETIC_RECIPES.items():
    if _o["config"] not in CONFIGS.values():
        CONFIGS[_name] = _o["config"]


def _step(env, task, reply):
    r = env.step(reply, EpisodeState(task=task))
    return r.reward, r.score, r.terminated


def test_the_quickstart_uses_the_builtin_env_with_reasoning_gyms_options():
    recipe = tomllib.loads((ROOT / "recipes" / "quickstart.toml").read_text())
    assert recipe["agent"]["name"] == "arithmetic"
    # the same [agent.options] build the reasoning_gym env (the recipe switches by name alone)
    assert ReasoningGymEnv.Options.model_validate({"task": "basic_arithmetic", **QUICKSTART})


def test_every_basic_arithmetic_recipe_uses_the_builtin_env():
    assert {"quickstart", "distill", "moe_replay", "smollm2", "examples/lora", "examples/gpu_qwen3"} <= set(ARITHMETIC_RECIPES)
    for p in (ROOT / "recipes").rglob("*.toml"):
        agent = tomllib.loads(p.read_text()).get("agent", {})
        if agent.get("name") == "reasoning_gym":  # what stays on reasoning-gym is a task the builtin env lacks
            assert agent["options"]["task"] != "basic_arithmetic", p


@pytest.mark.parametrize("name", sorted(ARITHMETIC_RECIPES))
def test_each_recipes_streams_equal_the_reasoning_gym_envs(name):
    pytest.importorskip("reasoning_gym")
    o = {"task": "basic_arithmetic", **ARITHMETIC_RECIPES[name]}
    ours, theirs = ArithmeticEnv(**o), ReasoningGymEnv(**o)
    assert list(ours.tasks("eval", 0)) == list(theirs.tasks("eval", 0))
    assert list(itertools.islice(ours.tasks("train", 0), 500)) == list(itertools.islice(theirs.tasks("train", 0), 500))


def test_quickstart_problems_are_pinned_and_each_answer_is_the_sum():
    env = ArithmeticEnv(**QUICKSTART)
    train = list(itertools.islice(env.tasks("train", 0), 3))
    assert [(t["question"], t["answer"]) for t in train] == [
        ("What is 78 + 48?", "126"), ("What is 93 + 17?", "110"), ("What is 80 + 45?", "125")]
    evals = list(env.tasks("eval", 0))
    assert len(evals) == 256
    assert [(t["question"], t["answer"]) for t in evals[:3]] == [
        ("What is 5 + 40?", "45"), ("What is 41 + 79?", "120"), ("What is 19 + 49?", "68")]
    assert evals[0]["rg"] == {"task": "basic_arithmetic", "seed": EVAL_SEED_OFFSET, "size": 256, "index": 0,
                              "question": "Calculate 5 + 40."}
    held_out = {t["question"] for t in evals}
    for t in itertools.islice(env.tasks("train", 0), 9000):  # past one epoch of 8000
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", t["question"]).groups())
        assert 0 <= a <= 100 and 0 <= b <= 100 and t["answer"] == str(a + b)
        assert t["question"] not in held_out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_items_equal_reasoning_gyms_one_by_one(name):
    rg = pytest.importorskip("reasoning_gym")
    cfg = CONFIGS[name]
    mine = ArithmeticConfig.model_validate(cfg)
    for seed, size in [(0, 8000), (3, 8000), (EVAL_SEED_OFFSET, 256), (4 + EVAL_SEED_OFFSET, 256)]:
        theirs = rg.create_dataset("basic_arithmetic", **cfg, seed=seed, size=size)
        ours = AdditionProblems(mine, seed, size)
        for i in range(size):
            assert ours[i] == theirs[i], (name, seed, i)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_quickstart_task_streams_equal_the_reasoning_gym_envs(seed):
    """The train order (into the second epoch), the held-out split and the SFT draws of each
    seed are those of ``reasoning_gym`` with the same options."""
    pytest.importorskip("reasoning_gym")
    from molt_core.train.sft import examples_from_agent

    ours, theirs = ArithmeticEnv(**QUICKSTART), ReasoningGymEnv(task="basic_arithmetic", **QUICKSTART)
    assert list(ours.tasks("eval", seed)) == list(theirs.tasks("eval", seed))
    n = QUICKSTART["size"] + 500
    assert list(itertools.islice(ours.tasks("train", seed), n)) == list(itertools.islice(theirs.tasks("train", seed), n))
    assert examples_from_agent(ours, 64, seed) == examples_from_agent(theirs, 64, seed)


REPLIES = ["{a}", "{a}<|im_end|>", "  {a}\n", "{a}<|endoftext|>", "9{a}", "{a}00", "The answer is {a}.",
           "{a} + 1", "", " ", "x", "-{a}", "{w}", "{w}<|im_end|>", "{a}<|im_end|>extra", "<answer>{a}</answer>"]


@pytest.mark.parametrize("binary", [False, True])
def test_scores_equal_the_reasoning_gym_envs_on_correct_wrong_and_partial_replies(binary):
    pytest.importorskip("reasoning_gym")
    ours = ArithmeticEnv(**{**QUICKSTART, "binary": binary})
    theirs = ReasoningGymEnv(task="basic_arithmetic", **{**QUICKSTART, "binary": binary})
    tasks = list(ours.tasks("eval", 0))[:20] + list(itertools.islice(ours.tasks("train", 0), 20))
    for t in tasks:
        for reply in REPLIES:
            text = reply.format(a=t["answer"], w=int(t["answer"]) + 1)
            assert _step(ours, t, text) == _step(theirs, t, text), (t["question"], text)


def test_exact_scores():
    env = ArithmeticEnv(**{**QUICKSTART, "binary": False})
    t = next(env.tasks("eval", 0))  # "What is 5 + 40?" -> "45"
    assert _step(env, t, "45") == (1.0, 1.0, True)
    assert _step(env, t, " 45<|im_end|>\n") == (1.0, 1.0, True)
    assert _step(env, t, "145") == (2 / 3, 2 / 3, True)  # partial credit len(gold) / len(reply)
    assert _step(env, t, "The answer is 45.") == (2 / 17, 2 / 17, True)
    assert _step(env, t, "46") == (0.0, 0.0, True)
    assert _step(env, t, "") == (0.0, 0.0, True)
    binary = ArithmeticEnv(**QUICKSTART)  # the quickstart: binary = true
    assert _step(binary, t, "145") == (0.0, 2 / 3, True) and _step(binary, t, "45") == (1.0, 1.0, True)
    assert (default_score(None, "45"), default_score("4", "45"), default_score("45", "45")) == (0.0, 0.0, 1.0)


def test_subtraction_is_left_to_right():
    cfg = ArithmeticConfig(min_terms=3, max_terms=3, min_digits=1, max_digits=1, operators=["-"],
                           allow_parentheses=False)
    for i in range(50):
        item = AdditionProblems(cfg, 7, 50)[i]
        a, b, c = map(int, re.fullmatch(r"(\d+) - (\d+) - (\d+)", item["metadata"]["expression"]).groups())
        assert item["answer"] == str(a - b - c) and item["question"] == f"Calculate {a} - {b} - {c}."
    with pytest.raises(IndexError, match=r"index 50 is outside 0\.\.49"):
        AdditionProblems(cfg, 7, 50)[50]


@pytest.mark.parametrize("config, message", [
    ({**QUICKSTART["config"], "operators": ["*"]}, "agent.options.config.operators.0: Input should be '+' or '-'"),
    ({**QUICKSTART["config"], "allow_parentheses": True}, "agent.options.config.allow_parentheses: Input should be False"),
    ({k: v for k, v in QUICKSTART["config"].items() if k != "allow_parentheses"},
     "agent.options.config.allow_parentheses: Field required"),
    ({k: v for k, v in QUICKSTART["config"].items() if k != "operators"}, "agent.options.config.operators: Field required"),
    ({**QUICKSTART["config"], "max_terms": 1}, "max_terms (1) must be >= min_terms (2)"),
    ({**QUICKSTART["config"], "seed": 3}, "agent.options.config.seed: Extra inputs are not permitted"),
])
def test_unsupported_configs_are_refused_by_field(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ArithmeticEnv(**{**QUICKSTART, "config": config})


def test_other_tasks_and_answer_tags_are_refused():
    with pytest.raises(ValueError, match=re.escape("agent.options.task: Input should be 'basic_arithmetic'")):
        ArithmeticEnv(**{**QUICKSTART, "task": "chain_sum"})
    with pytest.raises(ValueError, match=re.escape("agent.options.answer_tag: Input should be None")):
        ArithmeticEnv(**{**QUICKSTART, "answer_tag": "answer"})


def test_works_without_reasoning_gym_and_the_reasoning_gym_env_names_the_extra(monkeypatch, tmp_path):
    from molt_core.cli import main

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if reasoning-gym were not installed
    env = ArithmeticEnv(**QUICKSTART)
    t = next(env.tasks("eval", 0))
    assert (t["question"], _step(env, t, "45")) == ("What is 5 + 40?", (1.0, 1.0, True))
    with pytest.raises(ModuleNotFoundError):
        ReasoningGymEnv(task="basic_arithmetic", **QUICKSTART)
    r = CliRunner().invoke(main, ["run", "examples/reasoning_gym", "--local", "--steps", "1", "--sft-steps", "0",
                                  "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "module 'reasoning_gym' (distribution reasoning-gym) is not installed: pip install 'molt-sdk[envs]'" in r.output
    assert not (tmp_path / "run").exists()
    listing = CliRunner().invoke(main, ["plugins"], env={"COLUMNS": "100"})
    lines = listing.output.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("  reasoning_gym "))
    assert lines[i + 1].strip() == "unusable here: pip install 'molt-sdk[envs]' (module 'reasoning_gym' is missing)"
    j = next(k for k, ln in enumerate(lines) if ln.startswith("  arithmetic "))
    assert "unusable" not in lines[j + 1]  # the quickstart's env needs no extra
