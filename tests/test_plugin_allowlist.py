"""MOLT_LOAD_PLUGINS, the allow-list beside MOLT_DISABLE_PLUGINS (issue 15, item 4), with two
third-party distributions made visible to importlib.metadata through sys.path (nothing installed)."""

from __future__ import annotations

import textwrap

import pytest

from molt_core.plugins import PluginError, load_plugins


@pytest.fixture
def two_dists(tmp_path, monkeypatch):
    for dist, mod, reward in (("molt-alpha", "molt_alpha_mod", "alpha"), ("molt-beta", "molt_beta_mod", "beta")):
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[molt]\n{mod} = {mod}\n")
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(f"""
            from molt_core.hookspecs import hookimpl

            @hookimpl
            def molt_register_rewards(register):
                register("{reward}", lambda response, task: 1.0)
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MOLT_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("MOLT_LOAD_PLUGINS", raising=False)
    return tmp_path


def _third_party(host):
    return sorted(n for n in host.infos if n.startswith("molt_alpha") or n.startswith("molt_beta"))


def test_unset_loads_all(two_dists):
    host = load_plugins()
    assert _third_party(host) == ["molt_alpha_mod", "molt_beta_mod"]
    assert {"alpha", "beta", "exact_match"} <= set(host.names("rewards"))


def test_allow_list_by_entry_point_or_distribution_name(two_dists, monkeypatch):
    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "molt_alpha_mod")
    host = load_plugins()
    assert _third_party(host) == ["molt_alpha_mod"]
    assert "exact_match" in host.names("rewards") and "beta" not in host.names("rewards")  # first-party still loads
    monkeypatch.setenv("MOLT_LOAD_PLUGINS", " molt-beta ")
    assert _third_party(load_plugins()) == ["molt_beta_mod"]


def test_empty_allow_list_loads_no_third_party(two_dists, monkeypatch):
    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "")
    host = load_plugins()
    assert _third_party(host) == [] and "molt_rewards" in host.infos


def test_deny_list_wins_over_allow_list(two_dists, monkeypatch):
    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "molt_alpha_mod,molt_beta_mod")
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt-alpha,molt_envs")
    host = load_plugins()
    assert _third_party(host) == ["molt_beta_mod"] and "molt_envs" not in host.infos


def test_allow_list_naming_a_missing_plugin_is_an_error(two_dists, monkeypatch):
    monkeypatch.setenv("MOLT_LOAD_PLUGINS", "molt_alpha_mod,molt_gamma")
    msg = r"^MOLT_LOAD_PLUGINS names molt_gamma, not an installed molt plugin \(installed: .*molt_alpha_mod, molt_beta_mod"
    with pytest.raises(PluginError, match=msg):
        load_plugins()
