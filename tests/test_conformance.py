"""Plugin conformance checks (issue 15, item 3): each fault injected is flagged, the clean
plugin passes, and `molt plugins --check` passes for every installed plugin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from molt_core.testing.conformance import check_host
from molt_core.plugins import PluginError, load_plugins
from molt_core.testing import check_plugins

GOOD = '''
from pydantic import BaseModel
from molt_core.agents import Env
from molt_core.hookspecs import hookimpl
from molt_core.types import Result

class LenOptions(BaseModel):
    cap: int = 10

def length(response, task, cap=10):
    return min(len(response), cap) / cap
length.Options = LenOptions

class Finite(Env):
    def tasks(self, split, seed):
        if split == "eval":
            yield from ({"i": i} for i in range(3))
            return
        while True:
            yield {"i": -1}
    def reset(self, task):
        return "hi"
    def step(self, action_text, state):
        return Result(reward=1.0, terminated=True)

@hookimpl
def molt_register_rewards(register):
    register("length", length)

@hookimpl
def molt_register_envs(register):
    register("finite", Finite)
'''

BAD = '''
import itertools, random
from pydantic import BaseModel
from molt_core.agents import Env
from molt_core.hookspecs import hookimpl
from molt_core.types import Result

class Need(BaseModel):
    must: int

def noisy(response, task):
    return random.random()

def needy(response, task, must):
    return 1.0
needy.Options = Need

class Endless(Env):
    def tasks(self, split, seed):
        yield from ({"i": i} for i in itertools.count())
    def reset(self, task):
        return "hi"
    def step(self, action_text, state):
        return Result(terminated=True)

class NoRoute:
    router_class = "X"
    def replay(self, model, routed):
        pass

@hookimpl
def molt_register_rewards(register):
    register("noisy", noisy)
    register("needy", needy)
    register("bad name", noisy)

@hookimpl
def molt_register_envs(register):
    register("endless", Endless)
    return {"endless": Endless}

@hookimpl
def molt_register_replay_backends(register):
    register("noroute", NoRoute())
'''


def _host(tmp_path, body, name="plug.py"):
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return load_plugins([str(f)], entry_points=False), str(f)


def test_clean_plugin_passes_every_check(tmp_path):
    host, spec = _host(tmp_path, GOOD)
    checks = {(c.kind, c.name, c.check): (c.status, c.detail) for c in check_host(host)}
    assert checks == {
        ("envs", "", "hook_returns"): ("ok", "molt_register_envs: 1 registered"),
        ("rewards", "", "hook_returns"): ("ok", "molt_register_rewards: 1 registered"),
        ("envs", "finite", "name"): ("ok", ""),
        ("envs", "finite", "shape"): ("ok", ""),
        ("envs", "finite", "options"): ("ok", ""),
        ("envs", "finite", "eval_finite"): ("ok", "3 eval tasks"),
        ("rewards", "length", "name"): ("ok", ""),
        ("rewards", "length", "shape"): ("ok", ""),
        ("rewards", "length", "options"): ("ok", ""),
        ("rewards", "length", "deterministic"): ("ok", "1.0"),  # "The answer is 42." capped at 10 chars
    }
    check_plugins([spec], entry_points=False)  # the pytest helper: no AssertionError


def test_each_fault_is_flagged(tmp_path):
    host, spec = _host(tmp_path, BAD)
    failed = {(c.kind, c.name, c.check): c.detail for c in check_host(host) if c.status == "fail"}
    assert set(failed) == {
        ("envs", "", "hook_returns"),
        ("envs", "endless", "eval_finite"),
        ("rewards", "noisy", "deterministic"),
        ("rewards", "bad name", "deterministic"),
        ("rewards", "bad name", "name"),
        ("rewards", "needy", "options"),
        ("replay_backends", "noroute", "shape"),
    }
    assert failed[("envs", "", "hook_returns")] == "molt_register_envs returned dict (use the register callback; return None)"
    assert failed[("envs", "endless", "eval_finite")] == "the eval split yields more than 100000 tasks (it must be finite)"
    assert failed[("rewards", "needy", "options")].startswith("Options field(s) must have no default")
    assert failed[("replay_backends", "noroute", "shape")] == "lacks route"
    assert failed[("rewards", "bad name", "name")] == "'bad name' must match ^[A-Za-z0-9][A-Za-z0-9_.\\-]*$"
    with pytest.raises(AssertionError, match=r"FAIL .*rewards/noisy: deterministic -- two calls on one input scored"):
        check_plugins([spec], entry_points=False)


def test_molt_example_gives_required_options(tmp_path):
    host, _ = _host(tmp_path, BAD.replace("needy.Options = Need", "needy.Options = Need\nneedy.molt_example = {'options': {'must': 3}}"))
    c = {(c.name, c.check): (c.status, c.detail) for c in check_host(host) if c.name == "needy"}
    assert c[("needy", "options")] == ("ok", "required field(s) must given by molt_example")
    assert c[("needy", "deterministic")] == ("ok", "1.0")


def test_name_clash_is_refused_before_checks(tmp_path):
    a = tmp_path / "a.py"
    a.write_text(textwrap.dedent(GOOD))
    b = tmp_path / "b.py"
    b.write_text(textwrap.dedent(GOOD))
    with pytest.raises(PluginError, match='reward name "length" is registered twice'):
        check_plugins([str(a), str(b)], entry_points=False)


def test_cli_check_passes_for_every_installed_plugin_and_fails_a_bad_one(tmp_path):
    cmd = [sys.executable, "-m", "molt_core.cli", "plugins", "--check"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.fullmatch(r"\d+ ok, \d+ skipped, 0 failed \(\d+ plugins\)", ok.stdout.splitlines()[-1])
    assert "FAIL" not in ok.stdout and "OK   molt_rewards rewards/code_tests: deterministic -- 1.0" in ok.stdout
    f = tmp_path / "bad.py"
    f.write_text(textwrap.dedent(BAD))
    bad = subprocess.run(cmd + ["--json", "--plugin", str(f)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stderr
    rows = [r for r in json.loads(bad.stdout) if r["status"] == "fail"]
    assert {(r["plugin"], r["kind"], r["name"], r["check"]) for r in rows} == {
        (str(f), k, n, c) for k, n, c in [("envs", "", "hook_returns"), ("envs", "endless", "eval_finite"),
                                          ("rewards", "noisy", "deterministic"), ("rewards", "bad name", "deterministic"),
                                          ("rewards", "bad name", "name"), ("rewards", "needy", "options"),
                                          ("replay_backends", "noroute", "shape")]}


def test_group_reward_is_probed_as_a_group(tmp_path):
    host, _ = _host(tmp_path, '''
        from molt_core.hookspecs import hookimpl
        from molt_core.rewards import group_reward

        @group_reward
        def rank(responses, tasks):
            return [float(len(r)) for r in responses]
        rank.molt_example = {"responses": ["a", "abc"], "task": {"q": 1}}

        @hookimpl
        def molt_register_rewards(register):
            register("rank", rank)
    ''')
    (c,) = [c for c in check_host(host) if c.check == "deterministic"]
    assert (c.status, c.detail) == ("ok", "[1.0, 3.0]")
