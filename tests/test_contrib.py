"""The contrib examples: a reward package installed into the venv appears in
``molt plugins --json``; the env package loads as a plugin and runs."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REWARD_PKG = ROOT / "contrib" / "molt-reward-example"
ENV_FILE = ROOT / "contrib" / "molt-env-example" / "molt_env_example" / "__init__.py"


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300)


# only this package among third-party plugins: a user's own plugin (say one scaffolded with
# `molt plugin new reward brevity`) must not clash with the example and fail these tests
ONLY_EXAMPLE = {**os.environ, "MOLT_LOAD_PLUGINS": "molt-reward-example"}


def _plugins_json() -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "molt_core.cli", "plugins", "--json"], capture_output=True, text=True,
                         timeout=120, env=ONLY_EXAMPLE)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def installed_reward_example():
    r = _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", str(REWARD_PKG))
    assert r.returncode == 0, r.stdout + r.stderr
    yield
    _pip("uninstall", "-y", "-q", "molt-reward-example")


def test_reward_example_installed_is_listed(installed_reward_example):
    rows = {r["name"]: r for r in _plugins_json()}
    row = rows["molt_reward_example"]
    assert row["distribution"] == "molt-reward-example" and row["version"] == "0.1.0"
    assert row["registered"] == {"rewards": ["brevity"]}
    assert set(row["options"]["rewards"]["brevity"]["properties"]) == {"max_chars", "weight"}
    assert "exact_match" in rows["molt_rewards"]["registered"]["rewards"]  # first-party still there


def test_reward_example_values(installed_reward_example):
    code = ("from molt_core.plugins import load_plugins; f = load_plugins().get('rewards', 'brevity'); "
            "print(f('12345678', {}, max_chars=4), f(' ab ', {}, max_chars=4), f('abcdef', {}, max_chars=3, weight=0.1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ONLY_EXAMPLE)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0.5", "1.0", "0.05"]


def test_env_example_as_a_plugin_file():
    from molt_core.agents import EpisodeState, make_agent
    from molt_core.plugins import load_plugins

    host = load_plugins([str(ENV_FILE)], entry_points=False)
    env = make_agent(host.get("envs", "reverse_word"), {"min_len": 3, "max_len": 4, "eval_size": 16})
    ev = list(env.tasks("eval", 0))
    tr = list(itertools.islice(env.tasks("train", 0), 500))
    assert len(ev) == 16 and not ({t["word"] for t in ev} & {t["word"] for t in tr})
    t = tr[0]
    assert env.reset(t) == f"Reverse: {t['word']}"
    assert env.step(t["word"][::-1] + "\n", EpisodeState(task=t)).reward == 1.0
    assert env.step(t["word"], EpisodeState(task=t)).reward == (1.0 if t["word"] == t["word"][::-1] else 0.0)
    with pytest.raises(ValueError, match=r"agent.options.*max_len \(2\) must be >= min_len \(3\)"):
        make_agent(host.get("envs", "reverse_word"), {"min_len": 3, "max_len": 2})


GRPO_VARIANT = ROOT / "contrib" / "molt-grpo-variant" / "molt_grpo_variant" / "__init__.py"


def test_grpo_variant_registers_and_is_refused_without_its_plugin(monkeypatch):
    """The contrib estimator resolves with ``--plugin``; without it, ``algo.advantage`` is refused
    by name, listing the registered estimators and how to load one."""
    from molt_core.config import ConfigError
    from molt_core.cli.recipe import load_config
    from molt_core.train.algorithms import resolve_algorithms

    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "")  # no installed third-party plugin (the reward example above)

    cfg = load_config("quickstart", ["algo.advantage=grpo_batch_std"])
    with pytest.raises(ConfigError, match=r"algo.advantage = 'grpo_batch_std': no estimator named 'grpo_batch_std'; "
                                          r"registered: dr_grpo, gae, grpo, .*--plugin"):
        resolve_algorithms(cfg)
    algos = resolve_algorithms(cfg.model_copy(update={"plugins": [str(GRPO_VARIANT)]}))
    assert algos.advantage == "grpo_batch_std" and algos.group_baseline and not algos.needs_critic
    with pytest.raises(ConfigError, match=r"algo.loss = 'nope': no loss named 'nope'; registered: cispo, gspo, ppo"):
        resolve_algorithms(load_config("quickstart", ["algo.loss=nope"]))


@pytest.mark.slow
def test_grpo_variant_runs_quickstart_through_plugin_path(tmp_path):
    """``molt run quickstart --plugin <file> --set algo.advantage=grpo_batch_std`` trains (~70 s)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "molt_core.cli", "run", "quickstart", "--plugin", str(GRPO_VARIANT),
                        "--set", "algo.advantage=grpo_batch_std", "--steps", "2", "--sft-steps", "0", "--local",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MOLT_LOAD_PLUGINS": ""})  # no installed third-party plugin
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/step" in row] == [1, 2]


def test_an_estimator_whose_signature_cannot_be_filled_is_refused_by_name(tmp_path, monkeypatch):
    """A registered estimator or loss names only the documented inputs; anything else is refused
    when the run resolves it (never a TypeError mid-step)."""
    from molt_core.config import ConfigError
    from molt_core.cli.recipe import load_config
    from molt_core.train.algorithms import resolve_algorithms

    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "")
    f = tmp_path / "bad_algo.py"
    f.write_text("from molt_core.hookspecs import hookimpl\n\n"
                 "@hookimpl\ndef molt_register_estimators(register):\n"
                 "    register('needs_cfg', lambda rewards, group_index, cfg: rewards)\n\n"
                 "@hookimpl\ndef molt_register_losses(register):\n"
                 "    register('plain', lambda logprobs, advantages: (-logprobs * advantages, {}))\n")
    cfg = load_config("quickstart", ["algo.advantage=needs_cfg", f"plugins=['{f}']"])
    with pytest.raises(ConfigError, match=r"takes 'cfg'; an estimator names only parameters from rewards, group_index"):
        resolve_algorithms(cfg)
    algos = resolve_algorithms(cfg.model_copy(update={"algo": cfg.algo.model_copy(update={"advantage": "grpo",
                                                                                         "loss": "plain"})}))
    assert algos.loss == "plain" and algos.estimator.__name__ == "grpo"


def test_grpo_variant_own_tests_pass():
    """The contrib package's own tests (hand-computed values), run as its author would run them."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        str(ROOT / "contrib" / "molt-grpo-variant" / "tests")], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "MOLT_LOAD_PLUGINS": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "3 passed" in r.stdout
