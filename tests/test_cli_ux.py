"""The compact ``molt plugins`` view and the hints of common command-line slips (issue 13,
items 8 and 8b)."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from molt_core.cli import main
from molt_core.cli.plugin_listing import NAMES_ONLY, compact_lines, summary
from molt_core.plugins import load_plugins


def plugin_file(tmp_path, name, body):
    p = tmp_path / f"{name}.py"
    p.write_text("from molt_core.hookspecs import hookimpl\n" + textwrap.dedent(body))
    return str(p)


LOCAL = """
    def shout(response, task):
        '''Scores an upper-case ``response``: 1.0 if :func:`str.isupper`, else 0.0. Second sentence.

        More detail that the compact view leaves out.'''
        return float(response.isupper())

    def a_very_long_reward_name_of_thirty(response, task):
        return 0.0

    class Ticker:
        '''Counts steps (see :class:`~molt_core.runtime.rundir.RunLog`).'''
        def log(self, step, metrics): ...
        def close(self): ...

    @hookimpl
    def molt_register_rewards(register):
        register("shout", shout)
        register("a_very_long_reward_name_of_thirty", a_very_long_reward_name_of_thirty)

    @hookimpl
    def molt_register_loggers(register):
        register("ticker", Ticker)
"""


def test_summary_is_the_first_sentence_without_markup():
    def f():
        """Build a :class:`~a.b.Engine` (e.g. for ``x``). Then more.

        Raises: nothing."""

    assert summary(f) == "Build a Engine (e.g. for x)."
    assert summary(lambda: 0) == ""

    class Described:
        def describe(self):
            return "[active] one\n  two"

    assert summary(Described()) == "[active] one two"


def test_compact_lines_exact(tmp_path, monkeypatch):
    plugin_file(tmp_path, "ux_local", LOCAL)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = load_plugins(["ux_local"], entry_points=False)
    lines = compact_lines(host, width=60)
    assert lines == [
        "rewards (2)",
        "  a_very_long_reward_name_of_thirty  [not installed]",
        "  shout" + " " * 21 + "Scores an upper-case response...",
        "loggers (1)",
        "  ticker" + " " * 20 + "Counts steps (see RunLog). [n...",
        "plugins: ux_local (not installed)",
        "molt plugins --verbose: options and hooks; --json:",
        "  everything; --check: conformance",
    ]
    assert all(len(x) <= 60 for x in lines)


def test_cli_plugins_compact_at_80_columns():
    r = CliRunner().invoke(main, ["plugins"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    host = load_plugins()
    # compact: one line per kind and per name (names-only kinds: one line), then the plugins / help /
    # sandbox footer -- the bound grows with what is registered, not with a fixed count
    listed = sum(1 if k in NAMES_ONLY else 1 + len(host.names(k)) for k in host.registries if host.names(k))
    assert len(lines) <= listed + 8, (len(lines), listed)
    assert max(len(x) for x in lines) <= 80
    for kind in ("rewards", "envs", "engines", "loggers"):  # every kind and name is listed, one line each
        assert f"{kind} ({len(host.names(kind))})" in lines
        for name in host.names(kind):
            assert sum(x.startswith(f"  {name} ") or x == f"  {name}" for x in lines) >= 1, name
    assert "  reasoning_gym     Single-turn env over one reasoning-gym task." in lines
    assert "molt plugins --verbose: options and hooks; --json: everything; --check:" in lines


def test_cli_plugins_verbose_is_the_full_table_and_json_unchanged():
    r = CliRunner().invoke(main, ["plugins", "--verbose"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "distribution" in r.output and "molt_register_" in r.output
    assert "answer_field" in r.output  # exact_match's options appear only in the full table
    assert len(r.output.splitlines()) > 100
    rows = json.loads(CliRunner().invoke(main, ["plugins", "--json"]).output)
    assert set(rows[0]) == {"name", "distribution", "version", "source", "hooks", "registered", "options",
                            "descriptions", "missing"}


# -- hints for common slips (issue 13, item 8b) ------------------------------------------------

def test_misspelled_recipe_suggests_the_closest_name():
    r = CliRunner().invoke(main, ["run", "quickstrt"])
    assert r.exit_code == 2
    assert "recipe 'quickstrt' not found: not a file, and not a shipped recipe (did you mean 'quickstart'?)" in r.output
    r = CliRunner().invoke(main, ["run", "wandb"])  # an example recipe: suggested with its folder
    assert "(did you mean 'examples/wandb'?)" in r.output
    r = CliRunner().invoke(main, ["run", "zzzzzz"])
    assert "did you mean" not in r.output and "(chat_agent, dataset, distill," in r.output


def test_set_key_without_section_points_at_the_field():
    r = CliRunner().invoke(main, ["run", "quickstart", "--set", "steps=10", "--set", "lr=1e-3",
                                  "--set", "trainer.steps=3", "--set", "rollout.n_sampels_per_prompt=3",
                                  "--set", "xyzzy=1"])
    assert r.exit_code == 2
    lines = [x.strip() for x in r.output.splitlines()]
    assert "steps: unknown key (did you mean 'run.steps' or 'sft.steps'?)" in lines
    assert "lr: unknown key (did you mean 'trainer.lr' or 'sft.lr'?)" in lines
    # a field of that name in another section wins over a near name here ('eps')
    assert "trainer.steps: unknown key (did you mean 'run.steps' or 'sft.steps'?)" in lines
    assert "rollout.n_sampels_per_prompt: unknown key (did you mean 'n_samples_per_prompt'?)" in lines
    assert any(x.startswith("xyzzy: unknown key (known keys: run, model, engine,") for x in lines)


def test_unknown_plugin_name_suggests_and_says_how_to_load_a_plugin():
    from molt_core.config import RunConfig
    from molt_core.runtime.workers import check_rewards, load_agent

    host = load_plugins()
    cfg = RunConfig.model_validate({"rewards": {"exact_mach": {}}})
    with pytest.raises(ValueError) as e:
        check_rewards(cfg, host)
    msg = str(e.value)
    assert msg.startswith("rewards.exact_mach: no reward named 'exact_mach' (did you mean 'exact_match'?); "
                          "registered: code_tests, exact_match, ")
    assert msg.endswith(". A reward from another package loads with --plugin FILE.py (or a dotted module path), "
                        "or by pip install-ing the package that provides it (an entry point in group `molt`)")
    cfg = RunConfig.model_validate({"agent": {"name": "reasoning_gim"}})
    with pytest.raises(ValueError) as e:
        load_agent(cfg, host)
    msg = str(e.value)
    assert msg.startswith("agent.name: no env named 'reasoning_gim' (did you mean 'reasoning_gym'?); registered: ")
    assert ". An env from another package loads with --plugin FILE.py" in msg
    with pytest.raises(KeyError) as e:
        host.get("rewards", "qqqq")
    assert "did you mean" not in e.value.args[0] and e.value.args[0].startswith("no reward named 'qqqq'; registered: ")


def test_agent_errors_name_the_option_typed(tmp_path):
    (tmp_path / "noagent.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    (tmp_path / "agent.txt").write_text("x\n")
    cases = {
        "missing.py": f"error: --agent {tmp_path}/missing.py: no such file '{tmp_path}/missing.py'",
        "noagent.py": f"error: --agent {tmp_path}/noagent.py: '{tmp_path}/noagent.py' must define `agent` or "
                      "exactly one Env/ChatAgent subclass (found none)",
        "broken.py": f"error: --agent {tmp_path}/broken.py: '{tmp_path}/broken.py': importing it failed: "
                     "SyntaxError: invalid syntax (broken.py, line 1)",
        "agent.txt": f"error: --agent {tmp_path}/agent.txt: '{tmp_path}/agent.txt': not a .py file",
    }
    for f, want in cases.items():
        r = CliRunner().invoke(main, ["run", "quickstart", "--local", "--agent", str(tmp_path / f)])
        assert r.exit_code == 2, (f, r.output)
        assert " ".join(r.output.split()).startswith(want), (f, r.output)
    r = CliRunner().invoke(main, ["sft", "quickstart", "--agent", str(tmp_path / "broken.py")])
    assert r.exit_code == 2 and " ".join(r.output.split()).startswith(cases["broken.py"]), r.output


def test_bad_logger_option_fails_before_compute_naming_the_key(tmp_path):
    r = CliRunner().invoke(main, ["run", "quickstart", "--local", "--out", str(tmp_path / "run"),
                                  "--set", "loggers.wandb.mdoe=online"])
    assert r.exit_code == 2, r.output
    assert ("error: invalid logger options: loggers.wandb.mdoe: unknown option (did you mean 'mode'? options of "
            "wandb: mode, project, entity, name, tags, group)") in " ".join(r.output.split())
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_molt_sft_steps_is_sft_steps_and_redirected_output_gets_no_tqdm_bars(monkeypatch):
    import os

    import molt_core.train.sft as sft_mod

    seen = {}

    def fake_run_sft(cfg, host, out_dir=None, recipe_name="run"):
        seen["steps"] = cfg.sft.steps
        seen["bars_off"] = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
        return "runs/x/model"

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sft_mod, "run_sft", fake_run_sft)
    r = CliRunner().invoke(main, ["sft", "quickstart", "--steps", "7"])
    assert r.exit_code == 0, r.output
    assert seen == {"steps": 7, "bars_off": "1"}  # CliRunner's stderr is not a terminal
    assert "wrote runs/x/model (use --set model.path=runs/x/model)" in r.output


def test_run_dry_run_validates_and_prints_the_resolved_recipe_without_starting_anything(tmp_path):
    import tomllib

    from click.testing import CliRunner

    from molt_core.cli import main

    r = CliRunner().invoke(main, ["run", "quickstart", "--dry-run", "--steps", "7", "--set", "trainer.world_size=2",
                                  "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    cfg = tomllib.loads(r.output)
    assert cfg["run"]["steps"] == 7 and cfg["trainer"]["world_size"] == 2 and cfg["sft"]["steps"] == 1200
    assert not (tmp_path / "run").exists()  # no run directory, no Ray
    bad = CliRunner().invoke(main, ["run", "quickstart", "--dry-run", "--set", "trainer.wrld_size=2"])
    assert bad.exit_code == 2 and "did you mean 'world_size'" in bad.output
