"""LoRA through peft: wrap the policy, publish merged weights, checkpoint adapter + merged model.

With ``[trainer.lora]`` (:class:`molt_core.config.LoraSection`) the trainer wraps its model
(through the ``lora`` adapter, :class:`LoraAdapter`, registered by :mod:`molt_plugins.lora`)
with ``peft.get_peft_model`` (LoRA, Hu et al. 2021, arXiv 2106.09685): every targeted
``nn.Linear`` computes ``W x + (alpha / r) B A x`` with ``A`` ``[r, in]`` (Kaiming-uniform)
and ``B`` ``[out, r]`` (zeros, so the adapter starts as the identity), and only ``A``/``B``
are trained -- the base weights ``W`` never change.

* Engines receive the **merged** weights under the base model's own parameter names
  (:func:`merged_state_dict`: ``W + (alpha / r) B A`` from peft's ``get_delta_weight``; no
  ``base_model.model.`` prefix, no ``lora_A``/``lora_B`` keys), so any engine that loads a
  plain state dict runs the policy unchanged.
* The KL reference is the base model with the adapter disabled (peft's ``disable_adapter()``
  context, :class:`AdapterDisabled`): no second copy of the weights.
* An SFT warm start (:mod:`molt_core.train.sft`) trains the *base* weights with the adapter
  disabled (:func:`base_training`) -- the warm start plays the part of the pretrained model
  the adapter is then trained on; the reference is that warm-started base.
* A checkpoint holds ``model/`` (the merged model, loadable with ``from_pretrained``),
  ``adapter/`` (peft ``save_pretrained``: ``adapter_config.json`` +
  ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained`` over ``base/``)
  and ``base/`` (the base weights, so a resume is exact: merged minus delta is not).

Dropout is refused (the trainer runs in eval mode, see :mod:`molt_core.train.trainer`);
LoRA with ``trainer.world_size > 1`` is refused when the recipe is validated
(:class:`molt_core.config.RunConfig`); a GAE critic beside an adapter is a full copy of the plain
decoder (built before the adapter is injected: :class:`molt_core.train.Trainer`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from molt_core.plugins import modality
from molt_core.plugins.extras import with_install_hint
from molt_core.train.model_files import save_model

__all__ = ["AdapterDisabled", "LoraAdapter", "base_training", "base_state_dict", "is_lora", "load_lora_checkpoint",
           "merged_state_dict", "save_lora_checkpoint", "wrap"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(with_install_hint("trainer.lora needs peft", e)) from e
    return peft


def wrap(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with a LoRA adapter named ``default``.

    Args:
        model: a Hugging Face causal LM (its ``config.model_type`` picks peft's default
            target modules when ``lora.target_modules`` is None).
        lora: a :class:`molt_core.config.LoraSection` (``r``, ``alpha``, ``dropout``,
            ``target_modules``).

    Returns:
        The ``PeftModel``; only the adapter's parameters require grad.

    Raises:
        ImportError: peft is not installed (names the ``lora`` extra).
        ValueError: no module of the model matches ``target_modules`` (peft's message,
            prefixed with the field to fix); or a targeted layer's weight is tied to another
            parameter (``lm_head`` / ``embed_tokens`` with ``tie_word_embeddings``): the merged
            weights would untie them, which the engines and a saved ``model/`` cannot hold.
    """
    peft = _peft()
    conf = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=lora.target_modules, bias="none")
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
            wrapped = peft.get_peft_model(model, conf)
    except ValueError as e:
        raise ValueError(f"trainer.lora.target_modules = {lora.target_modules!r}: {e}") from e
    tied = _tied_targets(wrapped)
    if tied:
        raise ValueError(
            f"trainer.lora.target_modules = {lora.target_modules!r} puts an adapter on "
            f"{', '.join(f'{a} (its weight is tied to {b})' for a, b in tied)}: the merged policy would need two "
            f"different weights where the model (tie_word_embeddings) and every engine hold one, so engines and "
            f"checkpoints would silently run other weights; leave the tied layer out of target_modules")
    return wrapped


def _tied_targets(model: torch.nn.Module) -> list[tuple[str, str]]:
    """``(adapted layer, other parameter)`` for each LoRA layer whose base weight is also
    another module's parameter (tied input/output embeddings): ``W + delta`` then differs from
    the tied twin, which a plain state dict of a tied model cannot express."""
    owners: dict[int, list[str]] = {}
    for n, p in model.get_base_model().named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(_base_name(n))
    out = []
    for name, layer in _lora_layers(model).items():
        mine = f"{name}.weight"
        others = [n for n in owners.get(id(layer.get_base_layer().weight), []) if n != mine]
        if others:
            out.append((name, others[0]))
    return out


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (wrapped by :func:`wrap`)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """``{base-model module name: peft LoRA layer}`` of a peft model."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def _base_name(key: str) -> str:
    """A base-model state-dict key without peft's ``base_layer.`` level."""
    return key.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy as plain weights: the base model's state dict with each adapted layer's
    ``weight`` replaced by ``W + get_delta_weight()`` = ``W + (alpha / r) B A`` (fresh tensors;
    every other entry is the live base tensor, not a copy).

    Keys are the base model's own parameter names (``model.layers.0.self_attn.q_proj.weight``):
    no ``base_model.model.`` prefix, no ``base_layer`` level, no ``lora_*`` entries.

    Raises:
        TypeError: ``model`` is not a peft model.
    """
    if not is_lora(model):
        raise TypeError(f"merged_state_dict needs a peft model, got {type(model).__name__}")
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for k, v in model.get_base_model().state_dict().items():
        if ".lora_" in k:
            continue
        out[_base_name(k)] = v
    for name, layer in layers.items():
        delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters), torch.zeros(()))
        w = layer.get_base_layer().weight
        out[f"{name}.weight"] = w + delta.to(w.dtype)
    return out


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base weights (adapter left out) under the base model's own names (live tensors)."""
    return {_base_name(k): v for k, v in model.get_base_model().state_dict().items() if ".lora_" not in k}


class AdapterDisabled(torch.nn.Module):
    """The frozen reference of a LoRA policy: ``forward`` runs the policy under peft's
    ``disable_adapter()``, i.e. the base weights alone. Holds no weights of its own (the policy
    is not a submodule, so ``.to()``, ``.eval()`` and ``requires_grad_(False)`` on it leave the
    policy alone, and a checkpoint does not save it).

    ``forward(input_ids [B, T] int64, **kw)`` returns the policy's output object (``.logits``);
    ``kw`` (``use_cache``, ``logits_to_keep``, and a vision-language model's ``pixel_values``,
    ``image_grid_thw`` and 3D ``position_ids``) goes to the policy unchanged.
    ``get_rope_index`` is the policy's (the M-RoPE positions do not depend on the adapter).
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self._policy = [policy]  # a list: not registered as a submodule

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: Any = 0, **kw: Any) -> Any:
        policy = self._policy[0]
        with policy.disable_adapter():
            return policy(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep, **kw)

    def get_base_model(self) -> torch.nn.Module:
        """The policy's base model (a transformers model): what ``forward``'s keywords reach, so
        :func:`molt_core.train.forward.accepts` reads its signature (``logits_to_keep``, the KV
        cache of the shared-prefix forward) as it does for the peft policy itself."""
        return self._policy[0].get_base_model()

    @property
    def dtype(self) -> torch.dtype:
        """The policy's parameter dtype (this module holds none of its own)."""
        return next(self._policy[0].parameters()).dtype

    def get_rope_index(self, *args: Any, **kw: Any) -> Any:
        """The policy's ``get_rope_index`` (vision-language models; the modality's ``rope_index``)."""
        return modality().rope_index(self._policy[0])(*args, **kw)


@contextmanager
def base_training(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """Train the base weights of a LoRA policy (the SFT warm start): yields ``(forward model,
    parameters to optimise)`` -- for a peft model the base model under ``disable_adapter()``
    with its weights made trainable (frozen again on exit, the adapter untouched); for any
    other model the model itself and its trainable parameters."""
    if not is_lora(model):
        yield model, [p for p in model.parameters() if p.requires_grad]
        return
    base = [p for n, p in model.get_base_model().named_parameters() if ".lora_" not in n]
    for p in base:
        p.requires_grad_(True)
    try:
        with model.disable_adapter():
            yield model, base
    finally:
        for p in base:
            p.requires_grad_(False)
            p.grad = None


def _save_pretrained(model: torch.nn.Module, d: Path, state: dict[str, torch.Tensor]) -> None:
    save_model(model.get_base_model(), d, state)


def save_lora_checkpoint(model: torch.nn.Module, d: Path) -> None:
    """Write ``d/model`` (the merged weights, Hugging Face-loadable), ``d/base`` (the base
    weights) and ``d/adapter`` (peft ``save_pretrained``) of a peft ``model``."""
    _save_pretrained(model, d / "model", {k: v.contiguous() for k, v in merged_state_dict(model).items()})
    _save_pretrained(model, d / "base", {k: v.contiguous() for k, v in base_state_dict(model).items()})
    model.save_pretrained(str(d / "adapter"), safe_serialization=True)


def load_lora_checkpoint(model: torch.nn.Module, d: Path) -> None:
    """Restore the base weights from ``d/base`` and the adapter from ``d/adapter`` into the
    peft ``model`` (in place, bit-exact).

    Raises:
        FileNotFoundError: the checkpoint has no ``base/`` or ``adapter/`` (not written by a
            LoRA run: remove [trainer.lora] to resume it).
        ValueError: a saved key matches no weight of the model.
    """
    from safetensors.torch import load_file

    for sub in ("base", "adapter"):
        if not (d / sub).is_dir():
            raise FileNotFoundError(f"{d}: no {sub}/ in this checkpoint, but trainer.lora is set; it was not "
                                    f"written by a LoRA run (remove [trainer.lora] to resume it)")
    peft = _peft()
    names = {_base_name(k): k for k in model.get_base_model().state_dict() if ".lora_" not in k}
    state: dict[str, torch.Tensor] = {}
    for f in sorted((d / "base").glob("*.safetensors")):
        state.update(load_file(str(f)))
    unknown = [k for k in state if k not in names]
    if unknown:
        raise ValueError(f"{d / 'base'}: weights for unknown parameters {unknown[:5]}; wrong model for this checkpoint?")
    _, unexpected = model.get_base_model().load_state_dict({names[k]: v for k, v in state.items()}, strict=False)
    if unexpected:  # pragma: no cover - filtered above
        raise ValueError(f"{d / 'base'}: unexpected keys {unexpected[:5]}")
    adapter = peft.utils.load_peft_weights(str(d / "adapter"), device="cpu")
    res = peft.set_peft_model_state_dict(model, adapter)
    if getattr(res, "unexpected_keys", None):
        raise ValueError(f"{d / 'adapter'}: weights for unknown adapter parameters {res.unexpected_keys[:5]}")


class LoraAdapter:
    """The ``lora`` trainer adapter (``molt_register_adapters``): what the trainer, its
    checkpoints and the SFT warm start call when ``[trainer.lora]`` is set. Stateless; every
    method takes the policy (a peft model once :meth:`wrap` returned it)."""

    def wrap(self, model: torch.nn.Module, options: Any) -> torch.nn.Module:
        """:func:`wrap`: the policy with a LoRA adapter (``options``: the ``LoraSection``)."""
        return wrap(model, options)

    def reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference: the policy with its adapter disabled (:class:`AdapterDisabled`)."""
        return AdapterDisabled(model)

    def merged_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights to publish: :func:`merged_state_dict`."""
        return merged_state_dict(model)

    def base_training(self, model: torch.nn.Module) -> Any:
        """The SFT warm start's scope: :func:`base_training`."""
        return base_training(model)

    def save(self, model: torch.nn.Module, d: Path) -> None:
        """Write ``d/model``, ``d/base``, ``d/adapter``: :func:`save_lora_checkpoint`."""
        save_lora_checkpoint(model, d)

    def load(self, model: torch.nn.Module, d: Path) -> None:
        """Restore base weights and adapter from ``d``: :func:`load_lora_checkpoint`."""
        load_lora_checkpoint(model, d)
