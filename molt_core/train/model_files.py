"""One module's weights (and optimizer state) on disk: the files every checkpoint layout
shares (:mod:`molt_core.train.checkpoint`, :mod:`molt_core.train.lora`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["is_sharded", "load_model", "load_optimizer", "save_model"]


def save_model(model: torch.nn.Module, d: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` (safetensors) of ``model``, with ``state`` (a gathered full state
    dict) in place of its own when given; plain modules get one ``model.safetensors``."""
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


def load_model(model: torch.nn.Module, d: Path) -> None:
    """Load the ``*.safetensors`` of directory ``d`` into ``model`` (a sharded model: full
    tensors into this rank's shards). Keys ``save_pretrained`` dropped because they are tied
    to a saved parameter are accepted.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``d``.
        ValueError: weights for parameters the model lacks, or missing untied weights (sharded
            or not: checked before anything is loaded into a sharded model).
    """
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if is_sharded(model):  # full tensors into this rank's shards (a tied key saved once loads both)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # the same key checks as the plain path, made before anything is loaded
        owner: dict[str, int] = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
        live_keys = set(owner) | {n for n, _ in model.named_buffers()}
        unexpected = [k for k in state if k not in live_keys]
        if unexpected:
            raise ValueError(f"{d}: weights for unknown parameters {unexpected[:5]}; wrong model for this checkpoint?")
        saved = {owner[k] for k in state if k in owner}
        untied = [k for k in sorted(owner) if k not in state and owner[k] not in saved]
        if untied:
            raise ValueError(f"{d}: checkpoint lacks weights for {untied[:5]}")
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{d}: weights for unknown parameters {unexpected[:5]}; wrong model for this checkpoint?")
    # keys dropped by save_pretrained are tied to a saved parameter (e.g. lm_head <- embed_tokens)
    live = model.state_dict()
    saved_ptrs = {live[k].data_ptr() for k in state if k in live}
    untied = [k for k in missing if live[k].data_ptr() not in saved_ptrs]
    if untied:
        raise ValueError(f"{d}: checkpoint lacks weights for {untied[:5]}")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an FSDP2-sharded module."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``; for a sharded ``model`` (a checkpoint of one rank
    resumed on several) the parameter indices of ``state`` become parameter names and each
    rank keeps its shard of every moment (``set_optimizer_state_dict``, full state dict)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names: dict[int, str] = {}
    for n, prm in model.named_parameters():
        names.setdefault(id(prm), n)
    fqns = [names[id(prm)] for g in optimizer.param_groups for prm in g["params"]]
    full = {"state": {fqns[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
