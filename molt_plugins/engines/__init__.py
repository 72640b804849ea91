"""First-party rollout engines: ``transformers`` (embedded default) and ``vllm`` (extra
``molt-sdk[vllm]``)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


def _transformers_engine(**kwargs):
    from molt_core.engines.transformers_engine import TransformersEngine

    return TransformersEngine(**kwargs)


def _vllm_engine(**kwargs):
    """Build a :class:`~molt_core.engines.vllm_engine.VLLMEngine`.

    Raises:
        ImportError: vllm is not installed; the message names the ``molt-sdk[vllm]`` extra.
    """
    from molt_core.engines.vllm_engine import VLLMEngine

    return VLLMEngine(**kwargs)


@hookimpl
def molt_register_engines(register):
    """Register ``transformers`` and ``vllm`` (both imported lazily, on first use)."""
    register("transformers", _transformers_engine)
    register("vllm", _vllm_engine)
