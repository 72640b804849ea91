"""The trainer's optional features come from plugins (molt_core.train.features): without the
plugin that provides one, its option is refused by name, with the fix, before any compute."""

from __future__ import annotations

import pytest

from molt_core.config import ConfigError
from molt_core.plugins import load_plugins
from molt_core.runtime.trainer_group import ShardedTrainerWorker
from molt_core.train import Trainer
from molt_core.train.features import check_trainer_features, trainer_adapter, trainer_backend
from trainer_utils import tiny_cfg

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}


def _refused_without(monkeypatch, entry_point: str, kind: str, name: str, cfg, want: str) -> None:
    """With ``entry_point`` disabled, ``name`` is not registered for ``kind`` and ``molt run``'s
    check (before any compute) refuses ``cfg`` with ``want``; a config without the option passes."""
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", entry_point)
    host = load_plugins()
    assert name not in host.names(kind)
    with pytest.raises(ConfigError, match=want):
        check_trainer_features(cfg, host)
    check_trainer_features(tiny_cfg(), host)


def test_lora_without_the_adapter_plugin_is_refused_by_name(monkeypatch):
    cfg = tiny_cfg(trainer={"lora": LORA})
    assert type(trainer_adapter(cfg)).__name__ == "LoraAdapter"  # the first-party plugin registers `lora`
    assert trainer_adapter(tiny_cfg()) is None  # no option, no plugin lookup
    want = r"trainer.lora needs the adapter 'lora'.*molt_plugins.lora.*remove \[trainer.lora\]"
    _refused_without(monkeypatch, "molt_lora", "adapters", "lora", cfg, want)
    with pytest.raises(ConfigError, match=want):
        Trainer(cfg)


def test_world_size_without_the_backend_plugin_is_refused_by_name(monkeypatch, tmp_path):
    cfg = tiny_cfg(trainer={"world_size": 2})
    assert type(trainer_backend(cfg)).__name__ == "Fsdp2Backend"  # the first-party plugin registers `fsdp2`
    want = r"trainer.world_size = 2 needs the trainer backend 'fsdp2'.*molt_plugins.distributed.*set trainer.world_size = 1"
    _refused_without(monkeypatch, "molt_distributed", "trainer_backends", "fsdp2", cfg, want)
    with pytest.raises(ConfigError, match=want):  # a rank refuses before it joins any process group
        ShardedTrainerWorker(cfg).start(0, 2, f"file://{tmp_path / 'rdzv'}")


def test_a_run_whose_engine_no_plugin_registers_is_refused_by_name_before_the_run_dir(tmp_path):
    """Review of issue 26: with molt_engines disabled the run stopped with a KeyError traceback
    after making its run directory; now it is refused by name, exit 2, no run directory."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "MOLT_DISABLE_PLUGINS": "molt_engines"}
    r = subprocess.run([sys.executable, "-m", "molt_core.cli", "run", "quickstart", "--steps", "1", "--sft-steps", "0",
                        "--local", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "engine.name = 'transformers': no loaded plugin registers that engine (registered: (none))" in r.stderr
    assert "molt_engines (molt_plugins.engines)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
