"""First-party rollout engines: ``transformers`` (embedded default) and ``vllm`` (extra
``molt-sdk[vllm]``), and the vLLM engine's ``collective`` weight-sync transport."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


def _transformers_engine(**kwargs):
    """The embedded engine: the trainer's Hugging Face model class on CPU or one GPU. Builds a
    :class:`~molt_core.engines.transformers_engine.TransformersEngine` from ``kwargs``."""
    from molt_core.engines.transformers_engine import TransformersEngine

    return TransformersEngine(**kwargs)


def _vllm_engine(**kwargs):
    """The scale-out vLLM engine (extra ``molt-sdk[vllm]``). Builds a
    :class:`~molt_plugins.engines.vllm.engine.VLLMEngine` from ``kwargs``.

    Raises:
        ImportError: vllm is not installed; the message names the ``molt-sdk[vllm]`` extra.
    """
    from molt_plugins.engines.vllm.engine import VLLMEngine

    return VLLMEngine(**kwargs)


_vllm_engine.molt_requires = ("vllm",)  # type: ignore[attr-defined]  # `molt plugins` names molt-sdk[vllm] when missing


def _collective_transport():
    """The ``collective`` weight-sync transport (trainer rank 0 -> every vLLM worker; the sender's
    side needs no vLLM): :data:`molt_plugins.engines.vllm.weight_sync.TRANSPORT`."""
    from molt_plugins.engines.vllm.weight_sync import TRANSPORT

    return TRANSPORT


@hookimpl
def molt_register_engines(register):
    """Register ``transformers`` and ``vllm`` (both imported lazily, on first use)."""
    register("transformers", _transformers_engine)
    register("vllm", _vllm_engine)


@hookimpl
def molt_register_weight_sync_transports(register):
    """Register ``collective`` (imported lazily, on first use)."""
    register("collective", _collective_transport)
