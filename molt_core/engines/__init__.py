"""Rollout engines: the :class:`~molt_core.engines.base.RolloutEngine` contract and the embedded
``transformers`` default (the scale-out ``vllm`` engine is the plugin :mod:`molt_plugins.engines.vllm`)."""

from molt_core.engines.base import RolloutEngine
from molt_core.types import GenerationOutput

__all__ = ["GenerationOutput", "RolloutEngine"]
