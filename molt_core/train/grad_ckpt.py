"""Gradient checkpointing of a Hugging Face decoder that stays in eval mode.

Transformers checkpoints a layer only when its ``training`` flag is set, and the trainer keeps its
model in ``eval()``; :func:`enable_gradient_checkpointing` sets ``training`` on the checkpointed
layers alone, so the forward is the same function with and without checkpointing.
"""

from __future__ import annotations

import torch

__all__ = ["enable_gradient_checkpointing"]


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` (a transformers model or a peft model
    wrapping one), non-reentrant (``torch.utils.checkpoint``, ``use_reentrant=False``), so
    frozen inputs (LoRA) still get gradients; returns the number of layers checkpointed.

    Raises:
        ValueError: ``model`` has no ``activation_checkpointing_enable`` (transformers >= 5.x) nor
            ``gradient_checkpointing_enable``, or no checkpointable layer (set
            ``trainer.gradient_checkpointing = false``).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x (the old name warns)
        enable = lambda: model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)  # noqa: E731
    elif hasattr(model, "gradient_checkpointing_enable"):
        enable = lambda: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)  # noqa: E731
    else:
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} does not support it; "
                         f"set trainer.gradient_checkpointing = false")
    enable()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} has no checkpointable layer; "
                         f"set trainer.gradient_checkpointing = false")
    for m in layers:
        m.training = True  # the layer's flag only: its submodules stay in eval mode
    return len(layers)
