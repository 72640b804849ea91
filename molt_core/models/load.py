"""Loading a model and its tokenizer (builtin, directory, GGUF, ``pkg:`` or Hub id), and the
vision-token mask every loaded vision-language model gets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from molt_core.models.builtin import TINY_TOKENIZER_DIR, _builtin_config, _builtin_name, is_builtin, registered_builtin
from molt_core.models.hub import _hub_error, hub_kwargs, resolve_path

__all__ = ["DTYPES", "VISION_TOKEN_LOGIT", "device_for", "load_model", "load_tokenizer", "mask_vision_tokens",
           "vision_token_ids"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(num_gpus: float) -> torch.device:
    """The device of an actor given ``num_gpus`` (``trainer.num_gpus`` / ``engine.num_gpus``):
    ``cuda`` when it asked for a GPU and one is visible (Ray sets ``CUDA_VISIBLE_DEVICES`` to
    the GPUs it assigned), else ``cpu``. No other option decides it."""
    return torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")

def load_tokenizer(path: str, gguf_file: str | None = None) -> Any:
    """Load the tokenizer of a model ``path``.

    Args:
        path: ``builtin:tiny-qwen3`` / ``-moe`` / ``-large`` (the shipped 512-entry
            ChatML tokenizer), a plugin's builtin (its ``tokenizer()``), a local Hugging Face
            directory, ``pkg:<module>``, or a Hub id (downloaded unless ``HF_HUB_OFFLINE=1``; see :func:`hub_kwargs`).
        gguf_file: a GGUF file name inside ``path`` to read the tokenizer from.

    Returns:
        A transformers fast tokenizer with ``eos_token`` ``<|im_end|>`` and ``pad_token``
        ``<|endoftext|>`` for the builtins.

    Raises:
        ValueError: unknown builtin name.
        FileNotFoundError: ``path`` is neither a directory nor a Hub id, or a Hub id that is
            not cached while offline / cannot be downloaded (the message says which and the fix).
    """
    from transformers import AutoTokenizer

    if is_builtin(path):
        plugin = registered_builtin(_builtin_name(path))
        return plugin.tokenizer() if plugin else AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR),
                                                                                local_files_only=True)
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    if gguf_file:
        kw["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(name, **kw)
    except OSError as e:
        if Path(path).is_dir():
            raise
        raise _hub_error(path, kw, e) from e


#: logit given to a vision special token so it is never sampled: exp underflows to exactly 0 in
#: float32 and bfloat16, while the value stays finite (no -inf * 0 = nan in entropies) even
#: after a division by a small temperature
VISION_TOKEN_LOGIT = -1e9

_VISION_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model: Any) -> list[int]:
    """Ids of the vision special tokens a Qwen2-VL-family model's config names
    (``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``),
    sorted; empty for a text-only model."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "vision_config", None) is None:
        return []
    return sorted({int(v) for f in _VISION_TOKEN_FIELDS if isinstance(v := getattr(cfg, f, None), int)})


def mask_vision_tokens(model: Any) -> list[int]:
    """Make a vision-language model never put probability on its vision special tokens.

    A sampled ``<|image_pad|>`` would be an image-placeholder run with no image: the next
    prompt then has more image tokens than images, and the trainer refuses the rollout. So the
    output embedding's logits of :func:`vision_token_ids` are set to :data:`VISION_TOKEN_LOGIT`
    (the lowest finite value of a dtype that cannot hold it: -65504 in float16) by a forward hook on ``model.get_output_embeddings()`` -- the engine's sampling and
    behaviour logprobs and the trainer's recompute all see the same masked logits ``[..., V]``
    (logprobs of the other tokens are renormalised over them: ``log_softmax`` of the masked
    row). Idempotent; the ids are recorded on the model as ``molt_vision_token_mask`` (the
    hook's handle as ``molt_vision_token_mask_handle``).

    Returns:
        The masked ids (empty, and nothing installed, for a text-only model).
    """
    ids = vision_token_ids(model)
    if not ids or getattr(model, "molt_vision_token_mask", None) is not None:
        return ids
    head = model.get_output_embeddings()
    ids = [i for i in ids if i < head.weight.shape[0]]
    if not ids:
        return ids
    index = torch.tensor(ids, dtype=torch.long)

    def _mask(_module: Any, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        # float16 logits (float16 weights or autocast) cannot hold -1e9: use the dtype's lowest
        # finite value there (-65504; exp of it underflows to 0 as well)
        value = max(VISION_TOKEN_LOGIT, torch.finfo(out.dtype).min) if out.is_floating_point() else VISION_TOKEN_LOGIT
        return out.index_fill(-1, index.to(out.device), value)

    #: the hook's handle (``.remove()`` undoes the mask) and the masked ids
    model.molt_vision_token_mask_handle = head.register_forward_hook(_mask)
    model.molt_vision_token_mask = ids
    return ids


def _mask_vision(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its vision special tokens never sampled (:func:`mask_vision_tokens`)."""
    mask_vision_tokens(model)
    return model


def load_model(path: str, dtype: str = "float32", gguf_file: str | None = None, seed: int = 0) -> torch.nn.Module:
    """Load a causal LM in eval mode on CPU.

    Args:
        path: a local Hugging Face model directory, ``builtin:<name>``, ``pkg:<module>`` or a
            Hub id (downloaded unless ``HF_HUB_OFFLINE=1``; see module doc and :func:`hub_kwargs`).
        dtype: ``float32``, ``bfloat16`` or ``float16`` -- the parameter dtype.
        gguf_file: GGUF file name inside ``path`` (transformers dequantises it on load).
        seed: RNG seed of a builtin model's random init (the global RNG is left untouched);
            ignored for directories.

    Returns:
        A ``transformers`` ``PreTrainedModel`` (``Qwen3ForCausalLM`` /
        ``Qwen3MoeForCausalLM`` / ``Qwen2_5_VLForConditionalGeneration`` for builtins; a
        directory whose config has a ``vision_config`` loads through
        ``AutoModelForImageTextToText``) whose forward maps ``input_ids`` ``[B, T]``
        (int64) to ``logits`` ``[B, T, V]`` of ``dtype``.

    Raises:
        ValueError: unknown ``dtype`` or builtin name.
        FileNotFoundError: ``path`` is neither a builtin, a local directory nor a Hub id, or a
            Hub id that is not cached while offline / cannot be downloaded.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if is_builtin(path):
        from transformers import AutoModelForCausalLM

        name = _builtin_name(path)
        plugin, tok = registered_builtin(name), load_tokenizer(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if plugin is not None:
                model = plugin.build(tok)
            else:
                config = _builtin_config(name, len(tok), tok.pad_token_id, tok.eos_token_id)
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.to(torch_dtype).eval()
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if gguf_file:
        kw["gguf_file"] = gguf_file
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, **kw).eval()
        except ValueError as e:  # "Unrecognized configuration class": a vision-language model (Qwen2.5-VL, ...)
            if "configuration class" not in str(e):
                raise
            return _mask_vision(AutoModelForImageTextToText.from_pretrained(name, dtype=torch_dtype, **kw).eval())
    except OSError as e:
        if Path(path).is_dir():
            raise
        raise _hub_error(path, kw, e) from e


def declares_vision(path: str) -> bool:
    """Whether the model at ``path`` is a vision-language model by its name or its
    ``config.json`` alone (no weights loaded): a builtin VL model, or a local directory whose
    config has a ``vision_config``. A Hub id answers False (its images are refused per request)."""
    if is_builtin(path):
        return bool(getattr(registered_builtin(_builtin_name(path)), "vision", False))
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())
