"""First-party distillation teachers (``molt_register_teachers``)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_teachers(register):
    """Register ``hf_teacher`` (a frozen HF model sharing the student's tokenizer)."""
    from molt_plugins.teachers.hf_teacher import HFTeacher

    register("hf_teacher", HFTeacher)
