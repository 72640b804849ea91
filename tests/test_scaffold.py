"""`molt plugin new KIND NAME` (issue 15, item 2): the generated package is complete, its
tests pass as generated, and -- in a fresh venv -- it installs, is listed, passes
`molt plugins --check` and is used by `molt run quickstart`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from molt_core.testing.scaffold import KINDS, TEMPLATES, next_breaking, render_plugin

ROOT = Path(__file__).resolve().parent.parent
# generated tests per kind: (passed, skipped) when run uninstalled (the entry-point test skips)
EXPECTED = {"reward": (4, 1), "env": (5, 1), "judge": (4, 1), "teacher": (3, 1), "replay": (3, 1)}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


def test_templates_ship_as_package_data():
    files = [p for p in TEMPLATES.rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".j2" for p in files)
    assert not [p for p in files if any(part.startswith(".") for part in p.relative_to(TEMPLATES).parts)]
    # hatchling ships every file under a listed package (the wheel's contents are checked in
    # tests/test_packaging.py::test_the_wheel_carries_recipes_examples_agents_and_assets)
    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert "molt_core" in wheel["packages"] and not wheel.get("exclude")


def test_rendered_package_layout_and_entry_point(tmp_path):
    out = render_plugin("reward", "brevity", parent=tmp_path)
    assert out == tmp_path / "molt-reward-brevity"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        ".github/workflows/test.yml", ".gitignore", "README.md", "molt_reward_brevity/__init__.py",
        "molt_reward_brevity/py.typed", "pyproject.toml", "tests/test_brevity.py"]
    proj = tomllib.loads((out / "pyproject.toml").read_text())["project"]
    assert proj["name"] == "molt-reward-brevity"
    assert proj["entry-points"]["molt"] == {"molt_reward_brevity": "molt_reward_brevity"}
    assert proj["dependencies"] == ["molt-sdk>=0.1.0,<0.2", "pydantic>=2.6"]  # the hook-API compatibility policy
    assert "molt plugins --check" in (out / ".github/workflows/test.yml").read_text()


@pytest.mark.parametrize("version,bound", [("0.1.0", "0.2"), ("0.9.4", "0.10"), ("1.0.0", "2"), ("2.3.1", "3")])
def test_next_breaking(version, bound):
    assert next_breaking(version) == bound


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generated_tests_pass_as_generated(tmp_path, kind):
    out = render_plugin(kind, f"my_{kind}", parent=tmp_path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "molt_core.testing", "-p", "no:cacheprovider",
                        "-p", "no:randomly", str(out)], cwd=out, capture_output=True, text=True, timeout=300,
                       env=_env(PYTHONPATH=f"{out}{os.pathsep}{ROOT}"))
    passed, skipped = EXPECTED[kind]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"{passed} passed, {skipped} skipped" in r.stdout.splitlines()[-1]


def test_cli_refuses_bad_kind_name_and_non_empty_dir(tmp_path):
    def molt(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "molt_core.cli", "plugin", "new", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=_env(PYTHONPATH=str(ROOT)))

    r = molt("logger", "x")
    assert r.returncode == 2 and "'logger' is not one of 'reward', 'env', 'judge', 'teacher', 'replay'" in r.stderr
    r = molt("reward", "Bad-Name")
    assert r.returncode == 2 and "plugin name 'Bad-Name' must be a lowercase Python identifier" in r.stderr
    r = molt("reward", "brevity")
    assert r.returncode == 0 and r.stdout.strip() == "molt-reward-brevity"
    r = molt("reward", "brevity")
    assert r.returncode == 2 and "molt-reward-brevity exists and is not empty" in " ".join(r.stderr.split())


@pytest.mark.slow
def test_fresh_venv_new_install_test_list_check_run(tmp_path):
    """The issue's 'done when', for a reward and an env, in a fresh venv (the project venv's
    packages reachable through a site dir, molt-sdk installed editable from this checkout)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, molt = str(venv / "bin" / "python"), str(venv / "bin" / "molt")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "zz_molt_project.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    env = _env()

    def run(*cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env)
        assert r.returncode == 0, f"{cmd}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    pip = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e"]
    run(py, "-m", "pip", "uninstall", "-q", "-y", "setuptools")  # the venv's bundled one is too old for PEP 639
    run(*pip, str(ROOT))
    run(molt, "plugin", "new", "reward", "brevity")
    run(molt, "plugin", "new", "env", "adder")
    run(*pip, "./molt-reward-brevity")
    run(*pip, "./molt-env-adder")
    for d, n in (("molt-reward-brevity", 5), ("molt-env-adder", 6)):  # fixtures through the pytest11 entry point
        r = run(py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", d)
        assert r.stdout.splitlines()[-1].startswith(f"{n} passed")
    rows = {x["name"]: x for x in json.loads(run(molt, "plugins", "--json").stdout)}
    assert rows["molt_reward_brevity"]["registered"] == {"rewards": ["brevity"]}
    assert rows["molt_env_adder"]["registered"] == {"envs": ["adder"]}
    assert rows["molt_reward_brevity"]["distribution"] == "molt-reward-brevity"
    check = run(molt, "plugins", "--check").stdout
    assert "OK   molt_reward_brevity rewards/brevity: deterministic -- 1.0" in check
    assert "OK   molt_env_adder envs/adder: eval_finite -- 16 eval tasks" in check
    assert " 0 failed (" in check.splitlines()[-1]
    base = [molt, "run", "quickstart", "--local", "--set", "run.steps=2", "--set", "sft.steps=0",
            "--set", "eval.n_problems=4"]
    run(*base, "--set", "rewards.brevity={}", "--out", "r1")
    steps = [json.loads(x) for x in (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()]
    used = [m for m in steps if "reward/brevity/mean" in m]
    assert len(used) == 2 and all(m["reward/brevity/failed"] == 0.0 for m in used)
    run(*base, "--set", "agent.name=adder", "--set", "agent.options={}", "--out", "r2")
    first = json.loads((tmp_path / "r2" / "trajectories.jsonl").read_text().splitlines()[0])
    assert set(first["task"]) == {"a", "b", "answer"}
