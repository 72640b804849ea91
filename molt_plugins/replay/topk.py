"""Routing replay for transformers' softmax-then-top-k routers (Qwen3-MoE, OLMoE, Mixtral).

Each backend reproduces its router's forward (transformers 5.24,
``models/<name>/modeling_<name>.py``, class ``<Name>TopKRouter``) with one change: the
top-k *indices* are the recorded ones where a row is recorded (all ``K`` ids >= 0), and the
router's natural ``torch.topk`` choice elsewhere. The weights over the chosen experts are
always the live softmax probabilities gathered at those indices, renormalised as the model
does -- so they are never 0 and the router logits of the chosen experts receive gradient.

Example (case B11): logits ``[2.0, 1.0, 0.5, 0.0]``, top-2, recorded ``{0, 2}`` (natural
``{0, 1}``): softmax = ``[0.579259, 0.213097, 0.129250, 0.078394]``, the gathered weights
are ``[0.579259, 0.129250]``, renormalised ``[0.817574, 0.182426]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from molt_plugins.moe.routing import ReplayBackend

__all__ = ["MixtralReplay", "OlmoeReplay", "Qwen3MoeReplay", "replayed_topk"]


def replayed_topk(router_logits: torch.Tensor, recorded: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing with a replayed selection.

    Args:
        router_logits: ``[N, E]`` live router logits (any float dtype).
        recorded: ``[N, K]`` int64 recorded expert ids, ``-1`` rows = unrecorded.
        top_k: ``K``.
        renormalize: divide the gathered probabilities by their sum over the ``K`` experts.

    Returns:
        ``(weights [N, K] float32, indices [N, K] int64)``: ``indices`` = recorded rows where
        complete, else ``topk(softmax(logits))``; ``weights = softmax(logits.float())``
        gathered at ``indices`` (then renormalised if asked). Differentiable in the logits.
    """
    probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    natural = torch.topk(probs, top_k, dim=-1).indices
    valid = (recorded >= 0).all(-1, keepdim=True)
    idx = torch.where(valid, recorded, natural)
    w = probs.gather(-1, idx)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


class Qwen3MoeReplay(ReplayBackend):
    """Replay for ``Qwen3MoeTopKRouter``: ``softmax(logits, float32)`` -> top-k ->
    renormalise iff ``config.norm_topk_prob`` -> cast to the logits' dtype."""

    router_class = "Qwen3MoeTopKRouter"

    def route(self, router, hidden_states, recorded):
        """See :meth:`molt_plugins.moe.routing.ReplayBackend.route`."""
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(h, router.weight)
        w, idx = replayed_topk(logits, recorded, router.top_k, bool(router.norm_topk_prob))
        return logits, w.to(logits.dtype), idx


class OlmoeReplay(Qwen3MoeReplay):
    """Replay for ``OlmoeTopKRouter`` (the same arithmetic as Qwen3-MoE's router)."""

    router_class = "OlmoeTopKRouter"


class MixtralReplay(ReplayBackend):
    """Replay for ``MixtralTopKRouter``: ``softmax(logits.float())`` -> top-k -> always
    renormalised (equal to a softmax over the top-k logits); weights stay float32."""

    router_class = "MixtralTopKRouter"

    def route(self, router, hidden_states, recorded):
        """See :meth:`molt_plugins.moe.routing.ReplayBackend.route`."""
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(h, router.weight)
        w, idx = replayed_topk(logits.float(), recorded, router.top_k, True)
        return logits, w, idx
