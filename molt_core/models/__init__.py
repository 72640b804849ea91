"""Loading models and tokenizers: Hugging Face directories, GGUF files, and builtin tiny models.

A model ``path`` is either

* a local Hugging Face model directory (``config.json`` + weights, optionally a ``gguf_file``
  inside it, loaded through transformers' GGUF support; never a download),
* a Hugging Face Hub model id (``org/name``, optionally ``org/name@revision``): downloaded into
  the Hugging Face cache on first use, or read from that cache only when ``HF_HUB_OFFLINE=1``
  (see :func:`hub_kwargs`),
* ``pkg:<module>`` -- the directory of an installed Python package holding a model, or
* ``builtin:<name>`` -- a model the project builds from a config with a deterministic random
  init (see :data:`BUILTINS`):

  - ``builtin:tiny-qwen3``: ``Qwen3ForCausalLM``, hidden 128, 4 layers, 4 query / 2 KV heads
    of dim 32, MLP 384, tied embeddings, vocab = the shipped 512-entry ChatML tokenizer
    (``molt_core/assets/tiny_chatml``), 512 positions -- 853,376 parameters;
  - ``builtin:tiny-qwen3-moe``: ``Qwen3MoeForCausalLM`` of the same shape with 4 experts of
    MLP width 96 per layer, top-2 routing (for routing replay, R3);
  - ``builtin:tiny-qwen3-large``: ``Qwen3ForCausalLM`` over the same 512-entry ChatML
    tokenizer, hidden 192, 6 layers, 6 query / 3 KV heads of dim 32, MLP 576 --
    2,755,392 parameters (a distillation teacher for ``tiny-qwen3``, ``recipes/distill.toml``);
  - more from plugins (``molt_register_builtin_models``): ``builtin:tiny-qwen3-bigvocab`` (the
    real Qwen2/3 vocabulary, :mod:`molt_plugins.tiny_models`) and ``builtin:tiny-qwen2.5-vl``
    (vision-language, :mod:`molt_plugins.tiny_models.vl`).

Builtin tokenizers use the project's Qwen3-style ChatML template
(:data:`molt_core.assets.build_tiny_tokenizer.CHAT_TEMPLATE`).
"""

from __future__ import annotations

# re-exported: ``molt_core.models`` is the import path of every name below
from molt_core import _moved
from molt_core.models.builtin import BUILTINS, TINY_TOKENIZER_DIR, cache_dir, is_builtin, registered_builtin
from molt_core.models.checks import (MOE_KEYS, cache_keyword, check_model_positions, declares_experts, model_config,
                                     length_dependent_rope, returned_cache, routing_tool)
from molt_core.models.hub import check_model_source, hub_kwargs, hub_offline, local_model_dir, resolve_path
from molt_core.models.load import (DTYPES, VISION_TOKEN_LOGIT, declares_vision, device_for, load_model, load_tokenizer,
                                   mask_vision_tokens, vision_token_ids)

__all__ = ["BUILTINS", "DTYPES", "TINY_TOKENIZER_DIR", "cache_dir", "cache_keyword", "registered_builtin", "check_model_positions", "check_model_source", "model_config", "hub_kwargs", "length_dependent_rope", "returned_cache", "hub_offline", "is_builtin",
           "load_model", "load_tokenizer", "local_model_dir",
           "MOE_KEYS", "declares_experts", "routing_tool",
           "VISION_TOKEN_LOGIT", "declares_vision", "device_for", "mask_vision_tokens", "resolve_path", "vision_token_ids"]


def __getattr__(name: str) -> object:
    """Names that moved to the plugins of the builtin models they serve (deprecated here)."""
    return _moved.moved_attr(__name__, name)
