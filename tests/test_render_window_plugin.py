"""The ledger's window prover is a plugin (``molt_register_render_windows``): the first-party
``jinja`` prover registers through the host like a third party's; the server and the Env loop
hand it to every ledger; without it every extend check renders the whole conversation and the
plans are the same."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from fake_engine import EchoEngine
from molt_core.hookspecs import REGISTRATION_HOOKS
from molt_core.models import load_tokenizer
from molt_core.plugins import shared_host, window_prover
from molt_core.server import create_app
from molt_plugins.render_window import prove_window


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin:tiny-qwen3")


HISTORY = [{"role": "system", "content": "sys"}] + [
    m for i in range(4) for m in ({"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"})]


def chat(app) -> tuple[list[tuple[list[int], list[bool]]], dict[str, int], dict[str, int], object]:
    """Three requests of one session, each re-sending the history plus the last reply and a new
    user turn; returns the segments' (token ids, loss mask), the ledger's counts, render stats, proof."""
    c = TestClient(app)
    sid = c.post("/sessions", headers={"x-api-key": "adm"}).json()
    key = {"x-api-key": sid["api_key"]}
    msgs = HISTORY + [{"role": "user", "content": "go"}]
    for t in range(3):
        r = c.post(f"/s/{sid['session_id']}/v1/chat/completions", headers=key,
                   json={"messages": msgs, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        msgs = msgs + [r.json()["choices"][0]["message"], {"role": "user", "content": f"more{t}"}]
    led = app.state.sessions.ledger(sid["session_id"])
    segments = [(s.token_ids, s.loss_mask) for s in led.segments()]
    return segments, dict(led.counts), dict(led.render_stats), led.window_proof


def test_the_first_party_prover_registers_through_the_hook():
    assert REGISTRATION_HOOKS["render_windows"] == "molt_register_render_windows"
    reg = shared_host().registries["render_windows"]
    assert list(reg) == ["jinja"] and reg["jinja"].plugin == "molt_render_window"
    assert window_prover() is prove_window


def test_the_server_checks_on_a_window_and_without_the_plugin_renders_in_full(tok, monkeypatch):
    """Same segments and counts either way; the window decides the extends only with the plugin."""
    with_plugin = chat(create_app(EchoEngine(tok), tok, admin_key="adm"))
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_render_window")
    assert window_prover() is None
    without = chat(create_app(EchoEngine(tok), tok, admin_key="adm"))
    assert with_plugin[0] == without[0]
    assert with_plugin[1] == without[1] == {"start": 1, "extend": 2, "rewrite": 0, "retry": 0}
    assert with_plugin[2] == {"window": 2, "full": 0} and without[2] == {"window": 0, "full": 2}
    assert with_plugin[3] is not None and without[3] is None


def test_the_env_loop_hands_the_prover_to_its_ledgers(tok, monkeypatch):
    """The RolloutWorker's ledgers (an Env's turns, the runtime's path) carry the registered
    prover's proof, and none with the plugin disabled."""
    from molt_core.testing import ScriptedEngine, _worker

    worker = _worker(None, ScriptedEngine(tok), {}, None, {}, {})
    assert worker.window_prover is prove_window and worker._ledger("g").window_proof is not None
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_render_window")
    worker = _worker(None, ScriptedEngine(tok), {}, None, {}, {})
    assert worker.window_prover is None and worker._ledger("g").window_proof is None
