"""One module's weights (and optimizer state) on disk: the files every checkpoint layout
shares (:mod:`molt_core.train.checkpoint`, adapter and trainer-backend plugins)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["load_model", "load_optimizer", "read_weights", "save_model"]


def save_model(model: torch.nn.Module, d: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` (safetensors) of ``model``, or of ``state`` (a gathered full state dict)
    when given; a plain module gets one ``model.safetensors``."""
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(d, safe_serialization=True, **({"state_dict": state} if state is not None else {}))
    else:
        from safetensors.torch import save_file

        d.mkdir(parents=True, exist_ok=True)
        state = state if state is not None else model.state_dict()
        seen: dict[int, str] = {}
        out = {}
        for k, v in state.items():  # tied tensors once (safetensors refuses shared storage)
            if v.data_ptr() in seen:
                continue
            seen[v.data_ptr()] = k
            out[k] = v.contiguous()
        save_file(out, str(d / "model.safetensors"))


def read_weights(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of directory ``d`` (name -> CPU tensor).

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``d``.
    """
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_model(model: torch.nn.Module, d: Path) -> None:
    """Load the ``*.safetensors`` of directory ``d`` into ``model``; keys that ``save_pretrained``
    dropped because they are tied to a saved parameter may be missing.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``d``.
        ValueError: weights for parameters the model lacks, or missing untied weights.
    """
    state = read_weights(d)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{d}: weights for unknown parameters {unexpected[:5]}; wrong model for this checkpoint?")
    # keys dropped by save_pretrained are tied to a saved parameter (e.g. lm_head <- embed_tokens)
    live = model.state_dict()
    saved_ptrs = {live[k].data_ptr() for k in state if k in live}
    untied = [k for k in missing if live[k].data_ptr() not in saved_ptrs]
    if untied:
        raise ValueError(f"{d}: checkpoint lacks weights for {untied[:5]}")


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` (a sharded model's loader is its trainer backend's)."""
    optimizer.load_state_dict(state)
