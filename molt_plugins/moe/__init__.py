"""First-party MoE routing record/replay (R3, arXiv 2510.11370) behind the replay-backend
protocol: registers the routing tool ``moe`` (:class:`molt_plugins.moe.tool.MoeRouting`).
The per-model replay backends register through ``molt_register_replay_backends``
(:mod:`molt_plugins.replay`); their base class is :class:`molt_plugins.moe.routing.ReplayBackend`."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_routing_tools(register):
    """Register ``moe``: record, replay and measure the routing of ``*TopKRouter`` models."""
    from molt_plugins.moe.tool import MoeRouting  # (on registration: `molt plugins` stays light)

    register("moe", MoeRouting())
