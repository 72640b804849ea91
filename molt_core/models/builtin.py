"""Builtin tiny models: the kernel's three (configs with a deterministic random init over the
shipped 512-entry ChatML tokenizer, see :mod:`molt_core.models`) and the ones plugins register
(``molt_register_builtin_models``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from molt_core.plugins import shared_host

__all__ = ["BUILTINS", "TINY_TOKENIZER_DIR", "cache_dir", "is_builtin", "registered_builtin"]

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_chatml"
#: the kernel's own builtin models (plugins register more: :func:`registered_builtin`)
BUILTINS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-large")


def is_builtin(path: str) -> bool:
    """True if ``path`` names a builtin model (``builtin:<name>``)."""
    return isinstance(path, str) and path.startswith("builtin:")


def registered_builtin(name: str) -> Any:
    """The builtin model ``name`` a plugin registered (``molt_register_builtin_models``: an
    object with ``tokenizer()``, ``build(tokenizer)`` and ``vision``), or None (the kernel's
    own, or no such model)."""
    reg = shared_host().registries["builtin_models"] if name not in BUILTINS else {}
    return reg[name].obj if name in reg else None


def _builtin_name(path: str) -> str:
    name = path.split(":", 1)[1]
    if name not in BUILTINS and registered_builtin(name) is None:
        known = [*BUILTINS, *shared_host().registries["builtin_models"]]
        raise ValueError(f"model.path {path!r} is not a builtin model; choose one of "
                         + ", ".join(f"builtin:{b}" for b in known) + " or give a local Hugging Face model directory (a "
                         "plugin's builtin needs its plugin loaded: molt-sdk's molt_tiny_models registers more)")
    return name


def cache_dir() -> Path:
    """Where builtin assets are built on first use: ``$MOLT_CACHE_DIR`` (default ``~/.cache/molt``)."""
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt"))


def _builtin_config(name: str, vocab_size: int, pad_id: int, eos_id: int) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=512,
        tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=pad_id, eos_token_id=eos_id,
        bos_token_id=None,
    )
    if name == "tiny-qwen3":
        return Qwen3Config(**common)
    if name == "tiny-qwen3-large":
        common.update(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
                      intermediate_size=576)
        return Qwen3Config(**common)
    return Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)

