"""The trainer's optional features come from plugins (molt_core.train.features): without the
plugin that provides one, its option is refused by name, with the fix, before any compute."""

from __future__ import annotations

import pytest

from molt_core.config import ConfigError
from molt_core.plugins import load_plugins
from molt_core.train import Trainer
from molt_core.train.features import check_trainer_features, trainer_adapter
from trainer_utils import tiny_cfg

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}


def test_lora_without_the_adapter_plugin_is_refused_by_name(monkeypatch):
    cfg = tiny_cfg(trainer={"lora": LORA})
    assert type(trainer_adapter(cfg)).__name__ == "LoraAdapter"  # the first-party plugin registers `lora`
    assert trainer_adapter(tiny_cfg()) is None  # no option, no plugin lookup
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_lora")
    host = load_plugins()
    assert "lora" not in host.names("adapters")
    want = r"trainer.lora needs the adapter 'lora'.*molt_plugins.lora.*remove \[trainer.lora\]"
    with pytest.raises(ConfigError, match=want):
        check_trainer_features(cfg, host)  # what `molt run` does before any compute
    with pytest.raises(ConfigError, match=want):
        Trainer(cfg)
    check_trainer_features(tiny_cfg(), host)  # a run without the option needs no plugin
