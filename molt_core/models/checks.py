"""What a loaded model is: its KV-cache keyword, whether it declares experts (and the MoE
routing tool serving it), and whether its rotary embedding depends on a forward's length."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from molt_core.config import ConfigError
from molt_core.models.builtin import BUILTINS, _builtin_config, _builtin_name, is_builtin
from molt_core.models.hub import hub_kwargs, resolve_path
from molt_core.plugins import shared_host

__all__ = ["MOE_KEYS", "cache_keyword", "check_model_positions", "declares_experts", "length_dependent_rope", "model_config",
           "returned_cache", "routing_tool"]


def cache_keyword(model: torch.nn.Module) -> str | None:
    """The keyword ``model.forward`` takes its KV cache by: ``cache`` (transformers >= 5.x),
    ``past_key_values`` (earlier), or None for neither; a peft model's base model is read.
    Used by the transformers engine and the trainer's shared-prefix forward."""
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


def routing_tool(model: Any = None, plugins: list[str] | tuple[str, ...] | None = None, replay: bool = False) -> Any:
    """The MoE routing tool (hook ``molt_register_routing_tools``, read from
    :func:`molt_core.plugins.shared_host` of the entry points and ``plugins``, None: the run's) serving
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


def model_config(path: str) -> Any:
    """``path``'s model config from its name or ``config.json`` alone (no weights), for the checks
    a run makes before it starts; None for a plugin's builtin.

    Raises:
        ValueError: an unknown ``builtin:`` name (the message lists the registered ones).
    """
    if is_builtin(path):
        name = _builtin_name(path)
        return _builtin_config(name, 512, 0, 0) if name in BUILTINS else None
    from transformers import AutoConfig

    name, kw = hub_kwargs(resolve_path(path))
    return AutoConfig.from_pretrained(name, **kw)


def check_model_positions(path: str, config: Any = None) -> None:
    """Refuse, before an RL run trains, a model whose rotary factors depend on the total
    length (:func:`length_dependent_rope`): the engine's cached decode, the trainer's full
    forward and its shared-prefix forward would compute different functions, so forward
    consistency could not hold. ``config`` (else read from ``path``'s ``config.json``; a
    ``builtin:`` model has static RoPE) is the model's config.

    Raises:
        ValueError: naming the rope type and the fix.
    """
    config = model_config(path) if config is None else config
    why = length_dependent_rope(config) if config is not None else None
    if why:
        raise ValueError(
            f"model.path {path!r}: {why}, so the engine (prefill, then cached decode) and the trainer (one full "
            f"forward) cannot compute the same logprobs; use a static rotary embedding: for longrope set "
            f"rope_scaling.short_factor equal to long_factor (and short_mscale to long_mscale) in config.json, for dynamic drop rope_scaling "
            f"(within max_position_embeddings it is the default RoPE) or use type 'linear' or 'yarn'")
