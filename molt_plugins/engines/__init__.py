"""First-party rollout engines: ``transformers`` (embedded default)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


def _transformers_engine(**kwargs):
    from molt_core.engines.transformers_engine import TransformersEngine

    return TransformersEngine(**kwargs)


@hookimpl
def molt_register_engines(register):
    """Register ``transformers`` (imported lazily)."""
    register("transformers", _transformers_engine)
