"""Rollout engines: the :class:`~molt_core.engines.base.RolloutEngine` contract and
implementations (embedded ``transformers`` default, scale-out ``vllm``)."""

from molt_core.engines.base import RolloutEngine
from molt_core.types import GenerationOutput

__all__ = ["GenerationOutput", "RolloutEngine"]
