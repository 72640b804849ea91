"""Builtin model ``builtin:tiny-qwen2.5-vl`` (registered by :mod:`molt_plugins.tiny_models`):
``Qwen2_5_VLForConditionalGeneration`` with text hidden 128, 2 layers, 4 query / 2 KV heads of
dim 32, MLP 384, M-RoPE sections [4, 6, 6], 1024 positions; vision tower depth 2, hidden 64,
2 heads, patch 7, spatial merge 2 (a 28x28 image is a 4x4 patch grid = 4 image tokens); over the
shipped ChatML tokenizer extended with the vision tokens (ids 512..515) and a template rendering
image parts. 661,312 parameters (200,896 in the vision tower)."""

from __future__ import annotations

from typing import Any

from molt_core.assets.build_tiny_tokenizer import VISION_TOKENS, VL_CHAT_TEMPLATE
from molt_core.models import TINY_TOKENIZER_DIR, mask_vision_tokens

__all__ = ["TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH", "TinyQwen25VL"]

#: 7-pixel patches, 2x2 merge -> one image token per 14x14 pixels; the image processor
#: (:func:`molt_plugins.vision.processor.tiny_image_processor`) resizes so that
#: ``MIN <= height * width <= MAX`` pixels: 14x14 (1 token) up to 56x56 (16 tokens).
TINY_VL_PATCH = 7
TINY_VL_MERGE = 2
TINY_VL_MIN_PIXELS = 14 * 14
TINY_VL_MAX_PIXELS = 56 * 56


def _add_vision_tokens(tok: Any) -> None:
    """Append the Qwen2-VL vision special tokens to the shipped 512-entry tokenizer (ids
    512..515, in :data:`~molt_core.assets.build_tiny_tokenizer.VISION_TOKENS` order) and switch
    it to the template that renders image parts."""
    from tokenizers import AddedToken

    base = len(tok)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in VISION_TOKENS]})
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    if ids != list(range(base, base + len(VISION_TOKENS))):
        raise RuntimeError(f"vision tokens got ids {ids}, expected {base}..{base + len(VISION_TOKENS) - 1}")
    tok.chat_template = VL_CHAT_TEMPLATE


def _vl_config(tok: Any) -> Any:
    from transformers import Qwen2_5_VLConfig

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])))
    text = dict(
        vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=384, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=TINY_VL_PATCH,
        spatial_merge_size=TINY_VL_MERGE, temporal_patch_size=2, out_hidden_size=128,
        window_size=TINY_VL_PATCH * TINY_VL_MERGE * 4, fullatt_block_indexes=[0, 1],
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **ids)


class TinyQwen25VL:
    """``builtin:tiny-qwen2.5-vl`` (module doc); its image processor is
    :func:`molt_plugins.vision.processor.load_vision_processor`."""

    vision = True

    def tokenizer(self) -> Any:
        """The shipped 512-entry tokenizer with the vision tokens and the VL chat template."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR), local_files_only=True)
        _add_vision_tokens(tok)
        return tok

    def build(self, tok: Any) -> Any:
        """The float32 model from a random init (the caller seeds the RNG), its vision tokens
        never sampled (:func:`molt_core.models.mask_vision_tokens`)."""
        import torch
        from transformers import Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration._from_config(_vl_config(tok), dtype=torch.float32)
        mask_vision_tokens(model)
        return model
