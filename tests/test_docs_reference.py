"""docs/reference/*.md are generated from the code (docs/gen_reference.py) and cannot drift; the
metric registry docs/metrics.toml covers every metric the source names and a real run writes, and
every clean-run value it states (exact, bound, range) holds in a real quickstart run."""

from __future__ import annotations

import importlib.util
import json
import re
import types
from pathlib import Path

import click
import pluggy
import pytest
from click.testing import CliRunner
from pydantic import Field, create_model
from pydantic.fields import FieldInfo

from molt_core.config import RunConfig, TrainerSection

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "docs" / "reference"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gen():
    return _gen()


@pytest.fixture(scope="module")
def pages(gen):
    return gen.render_all()


@pytest.fixture(scope="module")
def plugins(gen):
    return gen.plugin_options()


def test_committed_pages_equal_the_generated_ones(gen, pages):
    assert sorted(pages) == ["cli.md", "hooks.md", "metrics.md", "options.md"]
    assert gen.stale(pages, REF) == [], "run: python docs/gen_reference.py"


def test_stale_flags_a_changed_and_a_missing_page(gen, pages, tmp_path):
    for n, t in pages.items():
        (tmp_path / n).write_text(t)
    assert gen.stale(pages, tmp_path) == []
    (tmp_path / "hooks.md").write_text(pages["hooks.md"] + "\n")
    (tmp_path / "cli.md").unlink()
    assert gen.stale(pages, tmp_path) == ["hooks.md", "cli.md"]


# ---------------------------------------------------------------- options


def test_every_option_is_listed_under_its_set_key(gen, pages):
    rows = {r["key"]: r for r in gen.walk_options(RunConfig)}
    assert rows["trainer.lr"] == {"key": "trainer.lr", "type": "float", "default": "0.0003", "constraints": "> 0",
                                  "description": "Peak AdamW learning rate."}
    assert rows["async.max_staleness"]["constraints"] == ">= 0"  # the alias, not the field name async_
    assert rows["rollout.top_p"]["constraints"] == "> 0, <= 1"
    assert rows["algo.kl_estimator"]["type"] == '"k1" | "k2" | "k3"'
    assert rows["trainer.betas"]["default"] == "[0.9, 0.98]"
    assert rows["trainer.lora"]["type"] == "LoraSection | None"
    assert rows["trainer.lora.r"]["default"] == "8"
    # every leaf field of every section, nothing else
    def leaves(model, prefix=""):
        out = []
        for name, f in model.model_fields.items():
            key = prefix + (f.alias or name)
            sub = gen._section_model(f.annotation)
            if sub is None or f.default_factory is not sub:
                out.append(key)
            if sub is not None:
                out += leaves(sub, key + ".")
        return out
    assert list(rows) == leaves(RunConfig)
    assert len(rows) == 100
    for key in rows:
        assert f"| `{key}` |" in pages["options.md"]
    assert "| `trainer.lr` | float | `0.0003` | > 0 | Peak AdamW learning rate. |" in pages["options.md"]


def test_an_added_option_shows_up_and_one_without_a_description_is_refused(gen, plugins):
    class Trainer2(TrainerSection):
        fancy: int = Field(3, ge=1, le=9)
        """A new option."""

    Run2 = create_model("Run2", __base__=RunConfig, trainer=(Trainer2, Field(default_factory=Trainer2)))
    text = gen.render_options(Run2, plugins)
    assert "| `trainer.fancy` | int | `3` | >= 1, <= 9 | A new option. |" in text
    assert "| `trainer.lr` | float | `0.0003` | > 0 | Peak AdamW learning rate. |" in text  # base docs kept
    assert text != (REF / "options.md").read_text()  # the drift check fails

    Bare = create_model("Bare", __base__=RunConfig, extra_knob=(bool, False))
    with pytest.raises(gen.ReferenceError, match=r"Bare.extra_knob \(option 'extra_knob'\) has no description"):
        gen.render_options(Bare, plugins)


def test_a_removed_option_fails_the_check(gen, plugins):
    docs = gen.attribute_docs(RunConfig)
    fields = {n: (f.annotation, FieldInfo.merge_field_infos(f, description=docs.get(n)))
              for n, f in RunConfig.model_fields.items() if n != "checkpoint"}
    Less = create_model("Less", **fields)
    text = gen.render_options(Less, plugins)
    assert "`checkpoint.every`" not in text
    assert "`checkpoint.every`" in (REF / "options.md").read_text()


def test_first_party_plugin_options_are_listed(plugins, pages):
    names = [(k, n) for k, n, _ in plugins]
    assert ("rewards", "regex") in names and ("loggers", "wandb") in names and ("envs", "reasoning_gym") in names
    assert "| `rewards.exact_match.strip` | bool | `true` |  |" in pages["options.md"]


def test_every_reserved_reward_key_has_a_row(gen, pages, monkeypatch):
    from molt_core import rewards

    assert rewards.RESERVED_KEYS == ("weight", "timeout_s", "isolation")
    rows = {r["key"]: r for r in gen.reserved_reward_rows()}
    assert list(rows) == ["rewards.NAME.weight", "rewards.NAME.timeout_s", "rewards.NAME.isolation"]
    assert [(r["type"], r["default"], r["constraints"]) for r in rows.values()] == [
        ("float", "1.0", "finite"), ("float", repr(rewards.DEFAULT_TIMEOUT_S), "> 0"),
        ("str", '"thread"', '"thread" | "process"')]
    assert ('| `rewards.NAME.isolation` | str | `"thread"` | "thread" \\| "process" | Where one call runs'
            in pages["options.md"])
    # a reserved key dropped from the code: the committed page no longer matches
    monkeypatch.setattr(rewards, "RESERVED_KEYS", ("weight", "timeout_s"))
    assert "`rewards.NAME.isolation`" not in gen.render_options(RunConfig, [])
    assert gen.stale({"options.md": gen.render_all()["options.md"]}, REF) == ["options.md"]
    # a new reserved key without a description is refused by name
    monkeypatch.setattr(rewards, "RESERVED_KEYS", ("weight", "timeout_s", "isolation", "retries"))
    with pytest.raises(gen.ReferenceError, match="reserved reward key 'retries'"):
        gen.render_options(RunConfig, [])


# ---------------------------------------------------------------- hooks


def test_every_hookspec_is_rendered(pages):
    from molt_core import hookspecs

    specs = [n for n in dir(hookspecs) if n.startswith("molt_") and hasattr(getattr(hookspecs, n), "molt_spec")]
    assert len(specs) == 22
    for n in specs:
        assert f"\n## {n}\n" in pages["hooks.md"]
    assert "def molt_on_step_end(step: int, metrics: dict) -> None" in pages["hooks.md"]
    assert "| [`molt_configure`](#molt_configure) |  | no | yes |" in pages["hooks.md"]


def test_an_added_hook_shows_up_with_firstresult_and_one_without_a_docstring_is_refused(gen):
    spec = pluggy.HookspecMarker("molt")
    mod = types.ModuleType("fake_hookspecs")
    mod.PROJECT, mod.HOOK_API_VERSION = "molt", 99

    @spec(firstresult=True)
    def molt_pick(name: str) -> object:
        """Pick one."""

    mod.molt_pick = molt_pick
    text = gen.render_hooks(mod)
    assert "| [`molt_pick`](#molt_pick) |  | yes | no |" in text
    assert "def molt_pick(name: str) -> object\n```\n\nPluggy options: firstresult.\n\nPick one." in text

    @spec
    def molt_silent() -> None:
        pass

    mod.molt_silent = molt_silent
    with pytest.raises(gen.ReferenceError, match="hook molt_silent in fake_hookspecs has no docstring"):
        gen.render_hooks(mod)


# ---------------------------------------------------------------- CLI


def test_every_cli_command_is_rendered(pages):
    from molt_core.cli import main

    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        assert f"\n## `molt {name}`\n" in pages["cli.md"]
    assert "\n## `molt plugin new`\n" in pages["cli.md"]
    assert "| `--steps` | int, >= 1 |  | RL steps (run.steps); the SFT warm start still runs its sft.steps first. |" \
        in pages["cli.md"]


def test_an_added_cli_command_shows_up(gen):
    @click.group()
    def grp() -> None:
        """Top."""

    @grp.command()
    @click.option("--level", type=click.Choice(["a", "b"]), default="a", help="How much.")
    def polish() -> None:
        """Polish it."""

    text = gen.render_cli(grp, prog="x")
    assert "## `x polish`\n\n```text\nx polish [OPTIONS]\n```\n\nPolish it.\n" in text
    assert "| `--level` | a \\| b | a | How much. |" in text


# ---------------------------------------------------------------- metrics

SOURCES = [p for d in ("molt_core", "molt_plugins") for p in sorted((ROOT / d).rglob("*.py"))]


def _source_metric_names(namespaces: set[str]) -> set[str]:
    """Quoted ``ns/name`` literals in the source, ``{...}`` placeholders as ``<x>``; a bare
    ``ns/{k}`` (a prefix applied to names written elsewhere) is left out."""
    pat = re.compile(r"""f?["']((?:%s)/[A-Za-z0-9_@{}/.-]+)["']""" % "|".join(map(re.escape, sorted(namespaces))))
    out = set()
    for p in SOURCES:
        for m in pat.finditer(p.read_text()):
            key = re.sub(r"\{[^}]*\}", "<x>", m.group(1))
            if re.fullmatch(r"[a-z]+/<x>", key) or key.endswith("/"):
                continue
            out.add(key)
    return out


def _covered(gen, registry, key: str) -> bool:
    probe = key.replace("<x>", "x")
    return any(gen.metric_pattern(r["key"]).match(probe) for r in registry)


def test_registry_covers_every_metric_name_in_the_source(gen):
    registry = gen.load_metrics()
    namespaces = {r["key"].split("/", 1)[0] for r in registry if "/" in r["key"]}
    names = _source_metric_names(namespaces)
    assert "invariants/tokens_retokenized" in names and "reward/<x>/mean" in names
    missing = sorted(k for k in names if not _covered(gen, registry, k))
    assert missing == [], f"metrics without a docs/metrics.toml entry: {missing}"


def test_every_registered_metric_is_named_in_the_source(gen):
    text = "\n".join(p.read_text() for p in SOURCES)
    registry = gen.load_metrics()
    absent = [r["key"] for r in registry if "<" not in r["key"]
              and f'"{r["key"]}"' not in text and f"'{r['key']}'" not in text]
    assert absent == [], f"registry entries the code no longer writes: {absent}"


def test_registry_faults_are_flagged(gen, tmp_path):
    registry = gen.load_metrics()
    assert _covered(gen, registry, "reward/<x>/failed")
    assert not _covered(gen, registry, "invariants/brand_new")  # an unregistered metric is caught
    assert gen.metric_pattern("reward/<name>/mean").match("reward/regex/mean")
    assert not gen.metric_pattern("reward/<name>/mean").match("reward/a/b/mean")
    bad = tmp_path / "m.toml"
    bad.write_text('[[metric]]\nkey = "a/b"\nmeaning = "x"\nclean = ""\nwhen = "always"\n')
    with pytest.raises(gen.ReferenceError, match="metric 'a/b' lacks clean"):
        gen.load_metrics(bad)
    bad.write_text('[[metric]]\nkey = "a/b"\nmeaning = "x"\nclean = "0"\nwhen = "always"\n' * 2)
    with pytest.raises(gen.ReferenceError, match="metric 'a/b' is listed twice"):
        gen.load_metrics(bad)
    for clean in ("about 0.5", "varies", "varies:  ", "0 on policy", "< big"):  # prose goes in `note`
        bad.write_text(f'[[metric]]\nkey = "a/b"\nmeaning = "x"\nclean = "{clean}"\nwhen = "always"\n')
        with pytest.raises(gen.ReferenceError, match=f"metric 'a/b': clean value '{clean}' is not EXPR"):
            gen.load_metrics(bad)
    bad.write_text('[[metric]]\nkey = "a/b"\nmeaning = "x"\nclean = "0"\nnotes = "y"\nwhen = "always"\n')
    with pytest.raises(gen.ReferenceError, match="metric 'a/b' has unknown field"):
        gen.load_metrics(bad)


def test_the_clean_grammar_parses_renders_and_checks():
    gen = _gen()
    assert gen.parse_clean("0") == ("exact", [0.0])
    assert gen.parse_clean("< 1e-4") == ("bound", ("<", [1e-4]))
    assert gen.parse_clean("0..1") == ("range", ([0.0], [1.0]))
    assert gen.parse_clean("0.5..0.8") == ("range", ([0.5], [0.8]))
    assert gen.parse_clean("1 ± 1e-5") == ("near", ([1.0], 1e-5))
    assert gen.parse_clean("`eval.n_problems` * `eval.k`") == ("exact", ["eval.n_problems", "eval.k"])
    assert gen.parse_clean(">= `eval/pass@1`") == ("bound", (">=", ["eval/pass@1"]))
    assert gen.parse_clean("varies: machine-dependent") == ("varies", "machine-dependent")
    md = [gen.clean_md({"clean": c, "note": n}) for c, n in [
        ("0", "on policy"), ("`step`", ""), ("< 1e-4", "in float32"), ("0.5..0.8", ""), ("1 ± 1e-5", ""),
        ("`a.b` * `c.d`", ""), ("varies: the wall clock", "")]]
    assert md == ["0 on policy", "equals `step`", "below 1e-4 in float32", "0.5 to 0.8", "within 1e-5 of 1",
                  "equals `a.b` × `c.d`", "varies: the wall clock"]
    reg = [{"key": k, "clean": c} for k, c in [
        ("x/zero", "0"), ("x/ref", "`step`"), ("x/bound", "< 1e-4"), ("x/range", "0..1"), ("x/near", "1 ± 1e-5"),
        ("x/prod", "`a.n` * `a.k`"), ("y/<k>", ">= 0"), ("x/free", "varies: anything")]]
    opts = {"a": {"n": 4, "k": 2}}
    good = {"step": 3, "x/zero": 0.0, "x/ref": 3.0, "x/bound": 5e-5, "x/range": 1.0, "x/near": 1.000004,
            "x/prod": 8.0, "x/free": -7.0, "y/a": 2.0, "y/b": 0.0}
    assert gen.check_clean(reg, [good], opts) == []
    faults = {"y/b": -1.0, "x/zero": 1e-9, "x/ref": 2.0, "x/bound": 1e-4, "x/range": 1.01, "x/near": 1.0001,
              "x/prod": 6.0}
    clean = {r["key"]: r["clean"] for r in reg}
    for k, v in faults.items():
        assert gen.check_clean(reg, [{**good, k: v}], opts) == [
            f"step 3: {k} = {v!r}, clean run: {clean[{'y/b': 'y/<k>'}.get(k, k)]}"], k
    assert gen.check_clean(reg, [{**good, "x/zero": None}], opts) == ["step 3: x/zero = None, clean run: 0"]
    assert gen.check_clean(reg, [{"x/ref": 1.0}], opts) == [
        "step None: x/ref = 1.0, clean run: `step` (no metric 'step' in the row)"]
    assert gen.check_clean(reg, [{**good, "x/prod": 8.0}], {}) == [
        "step 3: x/prod = 8.0, clean run: `a.n` * `a.k` (no run option 'a.n')"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Two quickstart steps (in this process, no Ray): ``(metrics rows, resolved options)``."""
    import tomllib

    from molt_core.cli import main

    out = tmp_path_factory.mktemp("docs") / "run"
    r = CliRunner().invoke(main, ["run", "quickstart", "--local", "--steps", "2", "--sft-steps", "0",
                                  "--set", "eval.n_problems=4", "--set", "rollout.prompts_per_step=4",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = RunConfig.model_validate(tomllib.loads((out / "config.toml").read_text()))
    return rows, cfg.model_dump(by_alias=True)


def test_a_real_run_writes_exactly_the_registered_metrics(gen, real_run):
    """Every key the run writes is registered, and every ``always`` metric is in every training row."""
    rows, _ = real_run
    assert [x["step"] for x in rows] == [0, 1, 2]
    registry = gen.load_metrics()
    written = set().union(*rows)
    assert sorted(k for k in written if not _covered(gen, registry, k)) == []
    always = {x["key"] for x in registry if x["when"] == "always"}
    for row in rows[1:]:
        assert sorted(always - set(row)) == [], f"step {row['step']}"
    assert {"eval/pass@1", "eval/reward", "eval/failed", "eval/rollouts"} <= set(rows[0]) & set(rows[2])


# the registry's entries a quickstart run does not write (MoE, critic, distillation, SFT, named
# rewards, pass@k for k > 1): their clean values are checked only where a run writes them
NOT_IN_THE_QUICKSTART = [
    "invariants/routing_flip_rate", "invariants/routing_replay_mismatch", "invariants/routing_replay",
    "invariants/logprob_absdiff_max_noreplay", "invariants/logprob_absdiff_mean_noreplay", "routing/positions",
    "loss/value", "distill/reverse_kl", "critic/grad_norm", "critic/value_mean", "critic/return_mean",
    "critic/explained_variance", "reward/<name>/mean", "reward/<name>/failed", "sft/loss", "sft/tokens",
    "sft/grad_norm", "sft/lr", "sft/loss_first", "sft/loss_last"]


def test_every_clean_value_holds_in_a_real_run(gen, real_run):
    """Every registered metric the run writes reads its ``clean`` value in every row (exact values,
    bounds, ranges; ``varies`` entries excepted), and the entries it does not write are exactly the
    listed ones -- so a ``clean`` value that names a number is checked unless no quickstart writes it."""
    rows, options = real_run
    registry = gen.load_metrics()
    assert gen.check_clean(registry, rows, options) == []
    written = set().union(*rows)
    unwritten = [r["key"] for r in registry if not any(gen.metric_pattern(r["key"]).match(k) for k in written)]
    assert unwritten == NOT_IN_THE_QUICKSTART
    checked = [r["key"] for r in registry if r["key"] not in unwritten and not r["clean"].startswith("varies:")]
    assert len(checked) == 68
    assert rows[1]["loss/ratio_mean"] == 1.0 and rows[1]["invariants/tokens_retokenized"] == 0.0


def test_a_wrong_clean_value_fails_against_the_real_run(gen, real_run, tmp_path):
    rows, options = real_run
    text = gen.METRICS_TOML.read_text()
    for key, clean, wrong in [("loss/ratio_mean", '"1"', '"7"'),
                              ("train/shared_prefix_frac", '"0.5..0.8"', '"0.4..0.5"'),
                              ("train/rollouts", '"`rollout.prompts_per_step` * `rollout.n_samples_per_prompt`"',
                               '"`rollout.prompts_per_step`"'),
                              ("invariants/logprob_absdiff_max_onpolicy", '"< 1e-4"', '"< 1e-9"')]:
        entry = f'key = "{key}"\n'
        at = text.index(entry)
        end = text.index("clean = ", at)
        assert text[end:].startswith(f"clean = {clean}\n"), key
        bad = tmp_path / "m.toml"
        bad.write_text(text[:end] + f"clean = {wrong}" + text[end + len(f"clean = {clean}"):])
        found = gen.check_clean(gen.load_metrics(bad), rows, options)
        assert found and all(f": {key} = " in x for x in found), (key, found)
        assert len(found) == 2, found  # steps 1 and 2


# ---------------------------------------------------------------- the site's link hook


def test_site_hook_renders_repo_files_as_paths_and_leaves_broken_links_broken():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "docs" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ("[the agent](../../recipes/agents/visual_chat.py) "
            "[`recipes/quickstart.toml`](../../recipes/quickstart.toml) "
            "[guide](../../CONTRIBUTING.md#tests) [gpu](../gpu.md#weight-sync) [gone](../../nowhere.py) "
            "[web](https://example.org/x.md) ![plot](../img/bench_quickstart.png)\n"
            "```\n[in code](../../recipes/quickstart.toml)\n```\n")
    out = hooks._rewrite(page, "plugins", ROOT)
    assert out == ("the agent (`recipes/agents/visual_chat.py`) `recipes/quickstart.toml` "
                   "[guide](../contributing.md#tests) [gpu](../gpu.md#weight-sync) [gone](../../nowhere.py) "
                   "[web](https://example.org/x.md) ![plot](../img/bench_quickstart.png)\n"
                   "```\n[in code](../../recipes/quickstart.toml)\n```\n")
