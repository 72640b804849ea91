"""First-party vision modality: image processor, placeholder expansion, positions, wire images.

Registered as modality ``vision`` through ``molt_register_modalities``; the kernel reaches
images only through it (see :mod:`molt_plugins.vision.modality`)."""

from __future__ import annotations

from molt_core.hookspecs import Register, hookimpl
from molt_plugins.vision.modality import VisionModality


@hookimpl
def molt_register_modalities(register: Register) -> None:
    """Register the ``vision`` modality (Qwen2-VL-family image inputs)."""
    register("vision", VisionModality())

