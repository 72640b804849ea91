"""First-party rollout engines: ``transformers`` (embedded default) and ``vllm`` (extra
``molt-sdk[vllm]``)."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


def _transformers_engine(**kwargs):
    """The embedded engine: the trainer's Hugging Face model class on CPU or one GPU. Builds a
    :class:`~molt_core.engines.transformers_engine.TransformersEngine` from ``kwargs``."""
    from molt_core.engines.transformers_engine import TransformersEngine

    return TransformersEngine(**kwargs)


def _vllm_engine(**kwargs):
    """The scale-out vLLM engine (extra ``molt-sdk[vllm]``). Builds a
    :class:`~molt_core.engines.vllm_engine.VLLMEngine` from ``kwargs``.

    Raises:
        ImportError: vllm is not installed; the message names the ``molt-sdk[vllm]`` extra.
    """
    from molt_core.engines.vllm_engine import VLLMEngine

    return VLLMEngine(**kwargs)


_vllm_engine.molt_requires = ("vllm",)  # type: ignore[attr-defined]  # `molt plugins` names molt-sdk[vllm] when missing


@hookimpl
def molt_register_engines(register):
    """Register ``transformers`` and ``vllm`` (both imported lazily, on first use)."""
    register("transformers", _transformers_engine)
    register("vllm", _vllm_engine)
