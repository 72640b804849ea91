"""MoE routing replay in the trainer (R3, arXiv 2510.11370) and its metrics (moved from
``molt_core.train.routing_replay``; reached through the routing tool, :mod:`molt_plugins.moe.tool`).

The engine records which experts routed every sampled token (``batch.routed_experts``); the
trainer's policy forwards replay that selection through a registered backend
(``molt_register_replay_backends``) and record the selection actually used, and
:func:`routing_metrics` compares both with the record. The state lives on the trainer
(``replay_backend``, ``_route_recorder``, ``_routing_used``, ``_replaying``) so a sharded
trainer can merge it across ranks.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Iterator

import torch

from molt_plugins.moe.routing import RoutingRecorder, flip_rate, get_replay_backend, is_moe

if TYPE_CHECKING:  # (importing molt_core.train would load the trainer with every plugin host)
    from molt_core.train.ingress import Batch

__all__ = ["init_routing", "routing", "routing_metrics", "routing_noreplay"]


def init_routing(trainer: Any, backend: Any) -> None:
    """Set up routing record/replay on ``trainer`` for an MoE policy (nothing for a dense one):
    ``replay_backend``, ``_route_recorder``, ``_routing_used``, ``_replaying``.

    Raises:
        ValueError: ``model.routing_replay`` is on and no backend is registered for the
            model's ``config.model_type``.
    """
    trainer.replay_backend = None
    trainer._route_recorder = RoutingRecorder(trainer.model) if is_moe(trainer.model) else None
    trainer._routing_used = {}  # first row -> selection of its first forward
    trainer._replaying = True
    if trainer._route_recorder is None or not trainer.cfg.model.routing_replay:
        return
    trainer.replay_backend = backend if backend is not None else get_replay_backend(trainer.model, plugins=trainer.cfg.plugins)
    if trainer.replay_backend is None:
        mt = getattr(trainer.model.config, "model_type", "?")
        raise ValueError(
            f"model.routing_replay is true but no routing-replay backend is registered for model type "
            f"{mt!r}; register one with molt_register_replay_backends, or set model.routing_replay = false"
        )


@contextmanager
def routing(trainer: Any, model: torch.nn.Module, batch: Batch, rows: slice, T: int) -> Iterator[None]:
    """Around a policy forward over ``rows``: replay ``batch.routed_experts`` (when a
    backend is active) and record the selection actually used (first forward per row
    block in a step)."""
    rec = batch.routed_experts
    shadow = model is trainer.history.shadow  # an older version's weights: replay, no record
    if (model is not trainer.model and not shadow) or trainer._route_recorder is None or rec is None:
        yield
        return
    rec = rec[rows, :T]
    replay = trainer.replay_backend.replay(model, rec) if trainer.replay_backend is not None and trainer._replaying else nullcontext()
    if shadow:
        with replay:
            yield
        return
    with trainer._route_recorder, replay:
        yield
        used = trainer._route_recorder.take()
    trainer._routing_used.setdefault(int(rows.start or 0), used.view(rec.shape).cpu())


@torch.no_grad()
def routing_noreplay(trainer: Any, batch: Batch) -> dict[str, Any]:
    """The no-replay diagnostic (before the update): logprobs ``[B, T]`` and routing of a
    natural forward, when a replay backend is active and the batch carries routing."""
    if trainer.replay_backend is None or batch.routed_experts is None:
        return {}
    trainer._replaying, saved, trainer._routing_used = False, trainer._routing_used, {}
    try:
        lp, _ = trainer.recompute_logprobs(batch)
        return {"logprobs": lp, "used": trainer._routing_used}
    finally:
        trainer._replaying, trainer._routing_used = True, saved


def routing_metrics(trainer: Any, batch: Batch, prox: torch.Tensor, noreplay: dict[str, Any]) -> dict[str, float]:
    """R3 metrics of a step (empty for a dense policy or a batch without routing).

    Both rates are :func:`molt_plugins.moe.routing.flip_rate`: the fraction of (position, MoE
    layer) pairs whose selected top-k *set* differs from the engine's recorded one, at the
    positions whose logits score a sampled token (``t - 1`` for a sampled ``t``) that have
    a complete recorded selection. The selections are what the routers returned, captured
    by forward hooks on the router modules (:class:`molt_plugins.moe.routing.RoutingRecorder`).

    * ``invariants/routing_flip_rate`` -- always the trainer's *natural* router (no
      replay) against the engine's record: the no-replay pass when a replay backend is
      active, else the loss forward itself;
    * ``invariants/routing_replay_mismatch`` (replay only) -- the selection the replayed
      forward actually used against the record: 0 when the backend replays correctly;
    * ``invariants/logprob_absdiff_mean_noreplay`` / ``_max_noreplay`` -- |behaviour -
      recomputed| without replay (``invariants/logprob_absdiff_*`` are with it);
    * ``invariants/routing_replay`` -- 1 when replay was applied, ``routing/positions``.
    """
    rec = batch.routed_experts
    if trainer._route_recorder is None or rec is None:
        return {}
    mask = batch.mask
    pos = torch.zeros_like(mask)
    pos[:, :-1] = mask[:, 1:]
    used, count = flip_rate(trainer._routing_used, rec, pos)
    natural = flip_rate(noreplay["used"], rec, pos)[0] if noreplay else used
    out = {"invariants/routing_replay": float(trainer.replay_backend is not None),
           "invariants/routing_flip_rate": natural, "routing/positions": float(count)}
    if noreplay:
        out["invariants/routing_replay_mismatch"] = used
    lp_nat = noreplay.get("logprobs", prox)
    diff = (batch.behaviour_logprobs - lp_nat).abs()[mask]
    diff = diff[torch.isfinite(diff)]  # a token out of the natural forward's support has no finite size
    out["invariants/logprob_absdiff_mean_noreplay"] = float(diff.mean()) if diff.numel() else 0.0
    out["invariants/logprob_absdiff_max_noreplay"] = float(diff.max()) if diff.numel() else 0.0
    return out
