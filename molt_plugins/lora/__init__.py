"""First-party LoRA adapters (peft): the ``lora`` adapter behind the trainer's adapter hook
(:class:`molt_plugins.lora.adapter.LoraAdapter`; peft is imported when a run uses it)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_adapters(register):
    """Register ``lora`` (``[trainer.lora]``)."""
    from molt_plugins.lora.adapter import LoraAdapter  # here: loading the plugins (CLI start-up) imports no torch

    register("lora", LoraAdapter())
