"""Builtin models beyond the kernel's three are plugins (``molt_register_builtin_models``): the
first-party ``tiny-qwen3-bigvocab`` and ``tiny-qwen2.5-vl`` register through the host; without
their plugin the name is refused listing the builtins that remain; a third party's builtin
loads through the same hook under the kernel's seeded RNG."""

from __future__ import annotations

import pytest
import torch

from molt_core.hookspecs import REGISTRATION_HOOKS
from molt_core.models import declares_vision, load_model, load_tokenizer
from molt_core.plugins import shared_host, use_run_plugins


def test_first_party_builtins_register_through_the_hook():
    assert REGISTRATION_HOOKS["builtin_models"] == "molt_register_builtin_models"
    reg = shared_host().registries["builtin_models"]
    assert sorted(reg) == ["tiny-qwen2.5-vl", "tiny-qwen3-bigvocab"]
    assert {r.plugin for r in reg.values()} == {"molt_tiny_models"}
    assert declares_vision("builtin:tiny-qwen2.5-vl") and not declares_vision("builtin:tiny-qwen3-bigvocab")


def test_without_the_plugin_its_builtins_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_tiny_models")
    with pytest.raises(ValueError) as e:
        load_tokenizer("builtin:tiny-qwen2.5-vl")
    assert str(e.value) == ("model.path 'builtin:tiny-qwen2.5-vl' is not a builtin model; choose one of "
                            "builtin:tiny-qwen3, builtin:tiny-qwen3-moe, builtin:tiny-qwen3-large or give a local "
                            "Hugging Face model directory (a plugin's builtin needs its plugin loaded: molt-sdk's "
                            "molt_tiny_models registers more)")
    assert load_tokenizer("builtin:tiny-qwen3").vocab_size == 512  # the kernel's own need no plugin


def test_a_third_party_builtin_builds_under_the_seeded_rng(tmp_path, monkeypatch):
    f = tmp_path / "my_models.py"
    f.write_text(
        "import torch\n"
        "from molt_core.hookspecs import hookimpl\n"
        "from molt_core.models import load_tokenizer\n\n"
        "class Lin:\n"
        "    vision = False\n"
        "    def tokenizer(self):\n"
        "        return load_tokenizer('builtin:tiny-qwen3')\n"
        "    def build(self, tok):\n"
        "        return torch.nn.Linear(2, 3)\n\n"
        "@hookimpl\n"
        "def molt_register_builtin_models(register):\n"
        "    register('lin', Lin())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    use_run_plugins(["my_models"])
    try:
        a, b = load_model("builtin:lin", seed=3), load_model("builtin:lin", seed=3)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            want = torch.nn.Linear(2, 3)
        assert torch.equal(a.weight, want.weight) and torch.equal(b.weight, want.weight) and not a.training
        assert not torch.equal(load_model("builtin:lin", seed=4).weight, want.weight)
    finally:
        use_run_plugins([])

