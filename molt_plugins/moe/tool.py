"""The first-party MoE routing tool (hook ``molt_register_routing_tools``): transformers'
``*TopKRouter`` convention, recorded by :mod:`molt_plugins.moe.routing` and replayed in the
trainer by :mod:`molt_plugins.moe.routing_replay` through the ``model_type``'s replay backend."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from molt_plugins.moe.routing import RoutingRecorder, batch_routed_experts, is_moe
from molt_plugins.moe.routing_replay import init_routing, routing, routing_metrics, routing_noreplay

__all__ = ["MoeRouting"]


class MoeRouting:
    """Routing record / replay / metrics (R3) of models with ``*TopKRouter`` modules; the
    calling convention is ``molt_register_routing_tools``'s (:mod:`molt_core.hookspecs`)."""

    def is_moe(self, model: torch.nn.Module) -> bool:
        """True if ``model`` has a top-k router (:func:`molt_plugins.moe.routing.is_moe`)."""
        return is_moe(model)

    def recorder(self, model: torch.nn.Module) -> RoutingRecorder:
        """A :class:`~molt_plugins.moe.routing.RoutingRecorder` of ``model``'s routers (the
        engine attaches it). Raises ValueError for a model without routers."""
        return RoutingRecorder(model)

    def collate(self, routed: list[Any], T: int, where: list[str] | None = None) -> torch.Tensor | None:
        """Per-row ``routed_experts`` -> ``[B, T, L, K]`` int64 or None
        (:func:`~molt_plugins.moe.routing.batch_routed_experts`; raises ValueError)."""
        return batch_routed_experts(routed, T, where)

    def init_trainer(self, trainer: Any, backend: Any = None) -> None:
        """Set up record/replay on ``trainer``
        (:func:`~molt_plugins.moe.routing_replay.init_routing`; raises ValueError when
        ``model.routing_replay`` is on and the model type has no replay backend)."""
        init_routing(trainer, backend)

    def forward(self, trainer: Any, model: torch.nn.Module, batch: Any, rows: slice,
                T: int) -> AbstractContextManager[None]:
        """Replay and record around one policy forward over ``rows`` (first ``T`` positions)
        (:func:`~molt_plugins.moe.routing_replay.routing`)."""
        return routing(trainer, model, batch, rows, T)

    def noreplay(self, trainer: Any, batch: Any) -> dict[str, Any]:
        """The no-replay diagnostic pass (:func:`~molt_plugins.moe.routing_replay.routing_noreplay`)."""
        return routing_noreplay(trainer, batch)

    def metrics(self, trainer: Any, batch: Any, prox: torch.Tensor, noreplay: dict[str, Any]) -> dict[str, float]:
        """The step's R3 metrics (:func:`~molt_plugins.moe.routing_replay.routing_metrics`)."""
        return routing_metrics(trainer, batch, prox, noreplay)
