"""Plugin discovery, loading and validation errors (issue 2, item 3)."""

import json
import textwrap

import pytest
from click.testing import CliRunner

from molt_core.cli import main
from molt_core.plugins import PluginError, load_plugins


def plugin_file(tmp_path, name, body):
    p = tmp_path / f"{name}.py"
    p.write_text("from molt_core.hookspecs import hookimpl\n" + textwrap.dedent(body))
    return str(p)


def test_first_party_plugins_are_entry_points():
    host = load_plugins()
    dists = {i.name: i.distribution for i in host.plugin_infos()}
    assert dists["molt_rewards"] == "molt-sdk"
    assert "exact_match" in host.names("rewards")
    assert "transformers" in host.names("engines")
    assert host.get("rewards", "exact_match")("42", {"answer": "42"}) == 1.0


def test_local_file_plugin_registers(tmp_path):
    f = plugin_file(tmp_path, "myreward", """
        @hookimpl
        def molt_register_rewards(register):
            register("always_one", lambda response, task: 1.0)
    """)
    host = load_plugins([f], entry_points=False)
    assert host.names("rewards") == ["always_one"]
    assert host.infos[f].hooks == ["molt_register_rewards"]
    assert host.infos[f].registered == {"rewards": ["always_one"]}


def test_module_path_plugin(tmp_path, monkeypatch):
    plugin_file(tmp_path, "pkg_mod_plugin", """
        @hookimpl
        def molt_register_envs(register):
            register("my_env", object)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = load_plugins(["pkg_mod_plugin"], entry_points=False)
    assert host.names("envs") == ["my_env"]


def test_name_collision_names_both_plugins(tmp_path):
    a = plugin_file(tmp_path, "a", """
        @hookimpl
        def molt_register_rewards(register):
            register("exact_match", lambda r, t: 0.0)
    """)
    with pytest.raises(PluginError) as e:
        load_plugins([a])
    msg = str(e.value)
    assert 'reward name "exact_match" is registered twice' in msg
    assert '"molt_rewards" (molt-sdk)' in msg and a in msg


def test_import_failure_names_plugin(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(PluginError, match=r'Error importing plugin ".*broken.py" \(--plugin\): RuntimeError: boom at import'):
        load_plugins([str(bad)], entry_points=False)


def test_hookimpl_with_wrong_arguments(tmp_path):
    f = plugin_file(tmp_path, "wrongargs", """
        @hookimpl
        def molt_on_step_end(step, metrics, extra):
            pass
    """)
    with pytest.raises(PluginError, match=r"""plugin ".*wrongargs.py" \(not installed\) has an invalid hook implementation: .*\{'extra'\} are declared in the hookimpl but can not be found in the hookspec"""):
        load_plugins([f], entry_points=False)


def test_unknown_hook(tmp_path):
    f = plugin_file(tmp_path, "unknownhook", """
        @hookimpl
        def molt_register_rewardz(register):
            pass
    """)
    with pytest.raises(PluginError, match=r"unknown hook\(s\) molt_register_rewardz; this molt-sdk speaks hook API version 3"):
        load_plugins([f], entry_points=False)


def test_fewer_arguments_than_spec_is_fine(tmp_path):
    f = plugin_file(tmp_path, "fewer", """
        seen = []
        @hookimpl
        def molt_on_step_end(step):
            seen.append(step)
    """)
    host = load_plugins([f], entry_points=False)
    host.on_step_end(3, {"x": 1.0})
    import sys
    mod = next(m for n, m in sys.modules.items() if n.startswith("molt_local_plugin_fewer"))
    assert mod.seen == [3]


def test_disable_plugins_env(monkeypatch):
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_rewards, molt_envs")
    host = load_plugins()
    assert "molt_rewards" not in host.infos and "molt_envs" not in host.infos
    assert "molt_engines" in host.infos


def test_cli_plugins_json_and_table():
    r = CliRunner().invoke(main, ["plugins", "--json"])
    assert r.exit_code == 0, r.output
    rows = {d["name"]: d for d in json.loads(r.output)}
    assert rows["molt_rewards"]["distribution"] == "molt-sdk"
    assert "exact_match" in rows["molt_rewards"]["registered"]["rewards"]
    r = CliRunner().invoke(main, ["plugins"])
    assert r.exit_code == 0 and "molt_rewards" in r.output


def test_cli_plugins_shows_the_active_sandbox_backend(monkeypatch):
    from molt_plugins.sandbox import available_backends

    first = available_backends()[0]
    r = CliRunner().invoke(main, ["plugins", "--json"])
    desc = {d["name"]: d for d in json.loads(r.output)}["molt_envs"]["descriptions"]["sandbox_backends"]
    assert sorted(desc) == ["bwrap", "process", "unshare"]
    assert [n for n, d in desc.items() if d.startswith("[active]")] == [first]
    r = CliRunner().invoke(main, ["plugins"])
    assert r.exit_code == 0 and f"sandbox backend: {first} " in r.output
    monkeypatch.setenv("MOLT_SANDBOX_BACKEND", "process")  # the choice is the user's
    r = CliRunner().invoke(main, ["plugins"])
    assert "sandbox backend: process no PID namespace" in r.output


def test_sandbox_backend_plugin_hook(tmp_path, monkeypatch):
    """A lab's remote sandbox service plugs in through molt_register_sandbox_backends and is
    selected with MOLT_SANDBOX_BACKEND."""
    from molt_plugins import sandbox

    f = plugin_file(tmp_path, "remote_sbx", """
        from molt_plugins.sandbox import SandboxResult

        class Remote:
            name = "remote"
            calls = []
            def available(self):
                return True
            def describe(self):
                return "[available] a fake remote service"
            def run(self, request):
                self.calls.append(request)
                return SandboxResult(status="ok", returncode=0, stdout="remote\\n", stderr="", duration_s=0.0,
                                     isolation="remote", tests_completed=True if request.tests else None,
                                     backend="remote")

        @hookimpl
        def molt_register_sandbox_backends(register):
            register("remote", Remote())
    """)
    host = load_plugins([f], entry_points=False)
    assert host.names("sandbox_backends") == ["remote"]
    assert host.infos[f].hooks == ["molt_register_sandbox_backends"]
    monkeypatch.setattr(sandbox, "_plugin_backends", lambda: {"remote": host.get("sandbox_backends", "remote")})
    monkeypatch.setenv("MOLT_SANDBOX_BACKEND", "remote")
    r = sandbox.run_python("print(1)", timeout_s=2.0)
    assert (r.backend, r.stdout, r.tests_completed) == ("remote", "remote\n", None)
    from molt_plugins.rewards.code import code_tests

    assert code_tests("def add(a, b):\n    return 0\n", {"tests": "assert add(2, 3) == 5"}) == 1.0  # trusts it
    req = host.get("sandbox_backends", "remote").calls[-1]
    assert (req.code, req.tests, req.timeout_s) == ("def add(a, b):\n    return 0\n\n", "assert add(2, 3) == 5\n", 5.0)


def test_cli_run_reports_bad_recipe_and_bad_plugin(tmp_path):
    rec = tmp_path / "bad.toml"
    rec.write_text('[rollout]\nn_sampels_per_prompt = 4\nmax_tokens = "eight"\n')
    r = CliRunner().invoke(main, ["run", str(rec)])
    assert r.exit_code == 2
    assert "rollout.n_sampels_per_prompt" in r.output and "rollout.max_tokens" in r.output
    bad = tmp_path / "explodes.py"
    bad.write_text("raise ImportError('no module named nonexistent_dep')\n")
    r = CliRunner().invoke(main, ["run", "quickstart", "--plugin", str(bad)])
    assert r.exit_code == 2
    assert "explodes.py" in r.output and "nonexistent_dep" in r.output


def test_cli_version_and_recipes():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and "molt-sdk" in r.output
    r = CliRunner().invoke(main, ["recipes"])
    assert r.exit_code == 0 and "quickstart" in r.output
