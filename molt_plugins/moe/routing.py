"""MoE routing: record the experts each router picks, replay a recorded selection (R3).

Rollout Routing Replay (R3, Ma et al. 2025, arXiv 2510.11370): the rollout engine records,
for every position and MoE layer, the top-k expert ids its router chose; the trainer's
forward then uses exactly those experts, while the gate weights over them are recomputed
from the *live* router logits (so the router keeps receiving gradient).

This module is the model-agnostic plumbing (moved from ``molt_core.routing``, which still
imports with a ``DeprecationWarning``); the per-model arithmetic (how a router turns logits
into weights) lives in replay-backend plugins (``molt_register_replay_backends``, first-party
ones in :mod:`molt_plugins.replay`), selected by ``config.model_type``.

Routers are found by transformers' (>= 5) convention: every sparse MoE block owns a
``<Model>TopKRouter`` module whose forward maps hidden states ``[..., H]`` to
``(router_logits [N, E], router_scores [N, K], router_indices [N, K])`` over the ``N``
flattened tokens (row-major over ``[B, T]``). Recording is a forward hook on those modules;
replay swaps the router's ``forward`` for the duration of a ``with`` block.

Conventions: ``routed_experts`` is an integer array ``[..., L, K]`` (``L`` = number of MoE
layers in module order, ``K`` = top-k), ``-1`` where a position has no recorded selection
(padding, positions the engine never ran); such rows keep the router's natural choice.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from molt_core.plugins import shared_host

__all__ = [
    "ReplayBackend",
    "RoutingRecorder",
    "batch_routed_experts",
    "find_routers",
    "flip_mask",
    "flip_rate",
    "get_replay_backend",
    "is_moe",
    "routing_shape",
]


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of every MoE layer of ``model``, in module (= layer) order.

    A router is a module whose class name ends in ``TopKRouter`` (transformers >= 5:
    ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``, ...). Dense layers
    (e.g. Qwen3-MoE's ``mlp_only_layers``) have none, so ``L`` counts MoE layers only.

    Returns:
        A list of modules, empty for a dense model.
    """
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def is_moe(model: torch.nn.Module) -> bool:
    """True if ``model`` has at least one top-k router (see :func:`find_routers`)."""
    return bool(find_routers(model))


def routing_shape(model: torch.nn.Module) -> tuple[int, int]:
    """``(num_moe_layers, top_k)`` of ``model``.

    Raises:
        ValueError: ``model`` has no router, or its routers disagree on ``top_k``.
    """
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router (no module named *TopKRouter)")
    ks = {int(r.top_k) for r in routers}
    if len(ks) != 1:
        raise ValueError(f"{type(model).__name__}: routers use different top_k {sorted(ks)}; expected one")
    return len(routers), ks.pop()


class RoutingRecorder:
    """Forward hooks that capture the expert ids every router of ``model`` selects.

    Use as a context manager around forwards (hooks removed on exit), or :meth:`attach`
    once and keep it (the engine does). After each model forward, :meth:`take` returns
    the selection of that forward and clears the buffer.

    Args:
        model: a model with top-k routers (see :func:`find_routers`).

    Raises:
        ValueError: ``model`` has no router.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record")
        self.num_layers, self.top_k = routing_shape(model)
        self._buf: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles: list[Any] = []

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            idx = output[-1] if isinstance(output, (tuple, list)) else None
            if not (isinstance(idx, torch.Tensor) and not idx.is_floating_point() and idx.dim() == 2
                    and idx.shape[-1] == self.top_k):
                raise NotImplementedError(
                    f"{type(module).__name__} does not return (logits, scores, indices [N, {self.top_k}]); "
                    "routing cannot be recorded for this model"
                )
            self._buf[layer] = idx.detach()
        return hook

    def attach(self) -> RoutingRecorder:
        """Register the hooks (idempotent); returns ``self``."""
        if not self._handles:
            self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def detach(self) -> None:
        """Remove the hooks and clear the buffer."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clear()

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def clear(self) -> None:
        """Forget a partially recorded forward (e.g. one that raised)."""
        self._buf = [None] * self.num_layers

    def take(self) -> torch.Tensor:
        """The selection of the last forward: ``[N, L, K]`` int64 (``N`` = flattened tokens,
        row-major over the input's ``[B, T]``), on the model's device; clears the buffer.

        Raises:
            RuntimeError: a router did not run, or the routers saw different token counts.
        """
        missing = [i for i, t in enumerate(self._buf) if t is None]
        if missing:
            self.clear()
            raise RuntimeError(f"MoE layers {missing} recorded no routing in the last forward")
        ns = {int(t.shape[0]) for t in self._buf}  # type: ignore[union-attr]
        if len(ns) != 1:
            self.clear()
            raise RuntimeError(f"MoE layers saw different token counts {sorted(ns)} in one forward")
        out = torch.stack(self._buf, dim=1).long()  # type: ignore[arg-type]
        self.clear()
        return out


def flip_mask(selected: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a selected top-k *set* differs from the recorded one.

    Args:
        selected: ``[..., L, K]`` int expert ids a forward used.
        recorded: ``[..., L, K]`` int recorded ids, ``-1`` rows = unrecorded.

    Returns:
        ``(flipped, valid)``, both ``[..., L]`` bool: ``valid`` is True where the recorded
        row is complete (all ``K`` ids >= 0); ``flipped`` is True where valid and the sets
        differ (order within the ``K`` ids is ignored).

    Raises:
        ValueError: the shapes differ.
    """
    if selected.shape != recorded.shape:
        raise ValueError(f"selected {tuple(selected.shape)} and recorded {tuple(recorded.shape)} routing differ in shape")
    valid = (recorded >= 0).all(-1)
    diff = (selected.sort(-1).values != recorded.sort(-1).values).any(-1)
    return diff & valid, valid


def flip_rate(selected: dict[int, torch.Tensor], recorded: torch.Tensor, positions: torch.Tensor) -> tuple[float, int]:
    """Fraction of (position, MoE layer) pairs whose selected top-k set differs from the
    recorded one, over recorded rows at ``positions``.

    Args:
        selected: ``{first_row: [b, T_b, L, K]}`` -- the selection of forwards over row blocks
            ``first_row : first_row + b`` and their first ``T_b`` positions.
        recorded: ``[B, T, L, K]`` recorded ids, ``-1`` rows unrecorded.
        positions: ``[B, T]`` bool, the positions to count.

    Returns:
        ``(rate, count)``: flips / count (0.0 when ``count`` is 0) and the number of counted
        (position, layer) pairs.
    """
    flips = count = 0
    for start, sel in selected.items():
        b, t = sel.shape[:2]
        flipped, valid = flip_mask(sel, recorded[start:start + b, :t])
        m = valid & positions[start:start + b, :t, None]
        flips += int((flipped & m).sum())
        count += int(m.sum())
    return (flips / count if count else 0.0), count


def batch_routed_experts(routed: list[Any], T: int, where: list[str] | None = None) -> torch.Tensor | None:
    """Collate per-segment ``routed_experts`` into ``[B, T, L, K]`` int64, ``-1`` on padding
    and for segments without routing.

    Args:
        routed: per row, a segment's ``routed_experts`` (``[T_b, L, K]`` nested lists) or None.
        T: the padded length (>= every ``T_b``).
        where: per row, a name for error messages (default ``row <b>``).

    Returns:
        The tensor, or None when no row carries routing.

    Raises:
        ValueError: a row whose routing is not ``[T_b, L, K]`` with ``T_b <= T``, or rows
            disagreeing on ``(L, K)`` (the message names the row).
    """
    if all(r is None for r in routed):
        return None
    out: torch.Tensor | None = None
    for b, r in enumerate(routed):
        if r is None or len(r) == 0:
            continue
        name = where[b] if where is not None else f"row {b}"
        t = torch.as_tensor(r, dtype=torch.long)
        if t.dim() != 3 or t.shape[0] > T:
            raise ValueError(f"{name}: routed_experts has shape {tuple(t.shape)}; expected [T<={T}, layers, top_k]")
        if out is None:
            out = torch.full((len(routed), T, t.shape[1], t.shape[2]), -1, dtype=torch.long)
        elif tuple(t.shape[1:]) != tuple(out.shape[2:]):
            raise ValueError(
                f"{name}: routed_experts has [layers, top_k] = {list(t.shape[1:])}, other rows "
                f"{list(out.shape[2:])}; every segment of a batch must come from one model"
            )
        out[b, : t.shape[0]] = t
    return out


class ReplayBackend:
    """Base of a routing-replay backend: replays recorded expert ids in a model's routers.

    A backend (registered per ``config.model_type`` through ``molt_register_replay_backends``)
    subclasses this and implements :meth:`route` -- the router's own arithmetic with the
    selection given. :meth:`replay` does the rest: it splits ``routed_experts`` per layer,
    checks it, and swaps each router's ``forward`` inside the ``with`` block.

    Attributes:
        router_class: class name of the router modules this backend knows; :meth:`replay`
            refuses others.
    """

    router_class: str = ""

    def route(self, router: torch.nn.Module, hidden_states: torch.Tensor,
              recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's forward with the selection replayed.

        Args:
            router: the router module (its parameters give the live logits).
            hidden_states: ``[..., H]`` the router's input.
            recorded: ``[N, K]`` int64 recorded expert ids for the ``N`` flattened tokens,
                ``-1`` rows keep the natural selection.

        Returns:
            ``(router_logits [N, E], weights [N, K], indices [N, K])`` as the router returns.
        """
        raise NotImplementedError

    @contextmanager
    def replay(self, model: torch.nn.Module, routed_experts: torch.Tensor) -> Iterator[None]:
        """Within the block, every forward of ``model`` over ``[B, T]`` tokens uses
        ``routed_experts`` as its expert selection.

        Args:
            model: the policy (its routers must be of :attr:`router_class`).
            routed_experts: ``[B, T, L, K]`` int (any int dtype), ``-1`` where unrecorded;
                ``B, T`` must equal the shape of the ``input_ids`` of each forward run
                inside the block.

        Raises:
            ValueError: wrong rank, ``L``/``K`` not matching the model, an id ``>=`` the
                number of experts, a repeated id within a row, or (inside the block) a
                forward whose token count is not ``B * T``.
            TypeError: the model's routers are not of :attr:`router_class`.
        """
        routers = find_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router; nothing to replay")
        bad = {type(r).__name__ for r in routers} - {self.router_class}
        if bad:
            raise TypeError(f"{type(self).__name__} replays {self.router_class}, but the model has {sorted(bad)}")
        L, K = routing_shape(model)
        if routed_experts.dim() != 4 or tuple(routed_experts.shape[2:]) != (L, K):
            raise ValueError(
                f"routed_experts has shape {tuple(routed_experts.shape)}; expected [B, T, {L}, {K}] "
                f"(num_moe_layers={L}, top_k={K})"
            )
        rec = routed_experts.to(device=routers[0].weight.device, dtype=torch.long)
        E = int(routers[0].num_experts)
        if bool((rec >= E).any()):
            raise ValueError(f"routed_experts holds expert id {int(rec.max())}, but the model has {E} experts")
        srt = rec.sort(-1).values
        if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()):
            raise ValueError("routed_experts repeats an expert id within one top-k row")
        N = rec.shape[0] * rec.shape[1]
        flat = rec.reshape(N, L, K)
        saved = []
        for layer, router in enumerate(routers):
            saved.append((router, router.__dict__.get("forward")))
            router.forward = self._patched(router, flat[:, layer], layer)
        try:
            yield
        finally:
            for router, fwd in saved:
                if fwd is None:
                    del router.forward
                else:
                    router.forward = fwd

    def _patched(self, router: torch.nn.Module, recorded: torch.Tensor, layer: int):
        def forward(hidden_states: torch.Tensor):
            n = hidden_states.numel() // hidden_states.shape[-1]
            if n != recorded.shape[0]:
                raise ValueError(
                    f"routing replay: MoE layer {layer} got {n} tokens but routed_experts covers "
                    f"{recorded.shape[0]} (B * T); run the forward on the same [B, T] batch"
                )
            return self.route(router, hidden_states, recorded)
        return forward


def get_replay_backend(model: torch.nn.Module, host: Any = None, plugins: list[str] | tuple[str, ...] = ()) -> ReplayBackend | None:
    """The replay backend registered for ``model.config.model_type``, or None.

    Args:
        model: the policy.
        host: a :class:`molt_core.plugins.PluginHost`; when None, the process's
            :func:`molt_core.plugins.shared_host` of the entry points + ``plugins``.
        plugins: ``--plugin`` specs, used only when ``host`` is None.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    if host is None:
        host = shared_host(plugins)
    reg = host.registries.get("replay_backends", {})
    return reg[model_type].obj if model_type in reg else None
