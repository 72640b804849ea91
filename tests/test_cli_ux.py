"""The compact ``molt plugins`` view and the hints of common command-line slips (issue 13,
items 8 and 8b)."""

from __future__ import annotations

import json
import textwrap

from click.testing import CliRunner

from molt_core.cli import main
from molt_core.plugin_listing import compact_lines, summary
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
    assert len(lines) < 60, len(lines)
    assert max(len(x) for x in lines) <= 80
    host = load_plugins()
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
                            "descriptions"}
