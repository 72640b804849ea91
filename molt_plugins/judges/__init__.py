"""First-party LLM-as-judge plugins (``molt_register_judges``)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_judges(register):
    """Register ``llm_judge`` (an OpenAI-compatible endpoint scoring against a rubric)."""
    from molt_plugins.judges.llm_judge import LLMJudge

    register("llm_judge", LLMJudge)
