"""Every example recipe in recipes/examples/ validates against RunConfig, names registered
plugins, and builds its agent, rewards and loggers; (slow) each runs 2 steps end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molt_core.agents import make_agent
from molt_core.cli.recipe import load_config
from molt_core.plugins import load_plugins
from molt_plugins.rewards.base import check_options

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "recipes" / "examples").glob("*.toml"))
DOCS = ROOT / "docs" / "plugins"


def _needs_gpu(cfg) -> str | None:
    """Why a recipe cannot run here (it asks for GPUs and none is visible), or None. Such
    recipes (gpu_qwen3) are validated and built here; benchmarks/gpu_check.py runs them."""
    import torch

    if (cfg.engine.num_gpus > 0 or cfg.trainer.num_gpus > 0) and not torch.cuda.is_available():
        return "asks for GPUs (engine/trainer num_gpus > 0); run by benchmarks/gpu_check.py on a GPU machine"
    return None


@pytest.fixture(scope="module")
def host():
    return load_plugins()


def test_there_is_an_example_recipe_and_a_doc_page_per_first_party_plugin(host):
    names = {p.stem for p in EXAMPLES}
    first_party = {r.name for kind in ("rewards", "envs", "loggers") for r in host.registries[kind].values()
                   if r.distribution == "molt-sdk"}
    assert first_party - {"jsonl"} <= names, first_party - names  # jsonl is always on: no recipe needed
    for n in first_party:
        page = DOCS / f"{n}.md"
        assert page.is_file(), f"missing docs page {page}"
        text = page.read_text()
        assert "```toml" in text, f"{page} has no recipe snippet"
        obj = next(r.obj for kind in ("rewards", "envs", "loggers") for r in host.registries[kind].values() if r.name == n)
        for field in getattr(obj, "Options").model_fields:
            assert f"`{field}`" in text, f"{page} does not document option {field!r}"


@pytest.mark.parametrize("recipe", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_validates_and_builds(recipe, host):
    cfg = load_config(recipe)
    assert cfg.agent.name in host.names("envs")
    agent = make_agent(host.get("envs", cfg.agent.name), cfg.agent.options)
    assert next(iter(agent.tasks("eval", cfg.run.seed)))  # the held-out split is non-empty
    for name, opts in cfg.rewards.items():
        check_options(name, host.get("rewards", name), opts)
    for name in cfg.loggers:
        assert name in host.names("loggers")
    first = recipe.read_text().splitlines()[0]
    assert first.startswith("# Example: "), "first line is the description `molt recipes` shows"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_runs_two_steps(recipe, tmp_path):
    if _needs_gpu(load_config(recipe)):
        pytest.skip(_needs_gpu(load_config(recipe)))
    if "llm_judge" in load_config(recipe).rewards:
        pytest.skip("needs a judge endpoint (covered against a fake server in tests/test_judge.py)")
    if "mlflow" in load_config(recipe).loggers:
        pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "molt_core.cli", "run", str(recipe), "--out", str(out), "--set", "run.steps=2",
           "--set", "eval.every=0", "--set", "eval.n_problems=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.n_samples_per_prompt=2", "--set", "sft.steps=0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["rollout/failed"] == 0 for row in steps)
    assert all(row["invariants/tokens_retokenized"] == 0 for row in steps)
    if "tensorboard" in recipe.stem:
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    if "wandb" in recipe.stem:
        assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    if "mlflow" in recipe.stem:
        assert (out / "mlflow.db").is_file()


@pytest.mark.parametrize("recipe", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_recipe_runs_one_step_in_process(recipe, tmp_path, monkeypatch):
    """The same main job as `molt run`, with the workers in this process (`--local`)."""
    from molt_core import runtime

    cfg = load_config(recipe, ["run.steps=1", "eval.every=0", "eval.n_problems=2", "rollout.prompts_per_step=2",
                               "rollout.n_samples_per_prompt=2", "sft.steps=0"])
    if "llm_judge" in cfg.rewards:
        pytest.skip("needs a judge endpoint (covered against a fake server in tests/test_judge.py)")
    if "mlflow" in cfg.loggers:
        pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    if _needs_gpu(cfg) or cfg.trainer.world_size > 1:
        pytest.skip(_needs_gpu(cfg) or "trainer.world_size > 1 needs Ray (no --local)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    out = runtime.main_job(cfg, load_plugins(cfg.plugins), out_dir=str(tmp_path / "run"), local=True, recipe_name=recipe.stem)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step = [row for row in rows if row["step"] == 1]
    assert len(step) == 1 and step[0]["rollout/failed"] == 0
    assert step[0]["invariants/tokens_retokenized"] == 0 and step[0]["invariants/staleness_max"] == 0
    assert step[0]["rollout/trajectories"] == 4
