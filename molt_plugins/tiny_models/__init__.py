"""First-party builtin models beyond the kernel's three (``molt_register_builtin_models``):
``builtin:tiny-qwen3-bigvocab`` (the real Qwen2/3 vocabulary, :mod:`molt_plugins.tiny_models.bigvocab`)
and ``builtin:tiny-qwen2.5-vl`` (vision-language, :mod:`molt_plugins.tiny_models.vl`; its images
need the vision modality plugin)."""

from __future__ import annotations

from molt_core.hookspecs import Register, hookimpl
from molt_plugins.tiny_models.bigvocab import BigVocabQwen3, bigvocab_tokenizer_dir
from molt_plugins.tiny_models.vl import TinyQwen25VL

__all__ = ["BigVocabQwen3", "TinyQwen25VL", "bigvocab_tokenizer_dir"]


@hookimpl
def molt_register_builtin_models(register: Register) -> None:
    """Register ``tiny-qwen3-bigvocab`` and ``tiny-qwen2.5-vl``."""
    register("tiny-qwen3-bigvocab", BigVocabQwen3())
    register("tiny-qwen2.5-vl", TinyQwen25VL())
