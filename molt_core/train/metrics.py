"""The metrics of one :meth:`~molt_core.train.trainer.Trainer.train_step`, measured on its batch
before the update. Each metric is described in docs/README.md ("Metrics"); the few that table
leaves out are in docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import torch

from molt_core.algo.correction import Correction
from molt_core.algo.kl import kl_estimate
from molt_core.train.ingress import Batch
from molt_core.train.update import in_support
from molt_core.train.version_history import onpolicy_metrics

__all__ = ["batch_metrics"]


def batch_metrics(trainer: Any, batch: Batch, corr: Correction, prox: torch.Tensor, ent: torch.Tensor,
                  ref_lp: torch.Tensor | None, kl_keep: torch.Tensor, onpol: torch.Tensor, num_tokens: int,
                  noreplay: dict[str, Any]) -> dict[str, float]:
    """The step's metrics measured on its batch before the update (module docstring):
    correction, on-policy consistency, logprob differences, R3 routing, entropy, KL, counts.

    Args:
        trainer: the :class:`~molt_core.train.trainer.Trainer` (``cfg``, ``version``,
            ``kl_coef``, ``_routing_metrics``).
        batch: the step's batch; ``corr``: the correction the update used.
        prox: ``[B, T]`` float32 proximal logprobs (``-inf`` out of support); ``ent``: ``[B, T]``
            entropy (nats); ``ref_lp``: ``[B, T]`` reference logprobs or None; ``kl_keep``:
            ``[B, T]`` bool, the tokens the KL covers; ``onpol``: ``[N]`` |behaviour -
            recomputed| of stale tokens (:func:`molt_core.train.version_history.stale_absdiff`);
            ``noreplay``: the R3 no-replay diagnostic (may be empty).
    """
    cfg = trainer.cfg
    mask, beh = batch.mask, batch.behaviour_logprobs
    n_sampled = int(mask.sum())
    metrics = {k: float(v) for k, v in corr.metrics.items()}  # incl. invariants/staleness_max
    oos = corr.out_of_support
    metrics.update(onpolicy_metrics((beh - prox).abs()[mask & (batch.versions == trainer.version)], onpol))
    prox = in_support(prox, beh, oos)  # the metrics below are over in-support tokens
    diff = (beh - prox).abs()[mask & ~oos]
    metrics["invariants/logprob_absdiff_mean"] = float(diff.mean()) if diff.numel() else 0.0
    metrics["invariants/logprob_absdiff_max"] = float(diff.max()) if diff.numel() else 0.0
    metrics.update(trainer._routing_metrics(batch, prox, noreplay))
    metrics["entropy"] = float(ent[mask].mean()) if n_sampled else 0.0
    metrics["kl/behaviour_k3"] = float(kl_estimate(prox, beh, "k3")[mask].mean()) if n_sampled else 0.0
    kl_ref = 0.0
    if ref_lp is not None and bool(kl_keep.any()):
        kl_ref = float(kl_estimate(prox, ref_lp, cfg.algo.kl_estimator)[kl_keep].mean())
    metrics["kl"] = kl_ref
    metrics["kl/ref_out_of_support_frac"] = float((mask & ~kl_keep).sum()) / n_sampled if n_sampled else 0.0
    metrics["kl_coef"] = trainer.kl_coef
    if trainer.algo.needs_teacher:  # KL(student || teacher) on the student's own samples: k1
        metrics["distill/reverse_kl"] = float((prox - batch.teacher_logprobs)[mask].mean()) if n_sampled else 0.0
    keep = corr.keep.to(torch.bool)
    metrics["train/sequences"] = float(batch.size)
    metrics["train/rollouts"] = float(batch.rewards.numel())
    metrics["train/action_tokens"] = float(num_tokens)
    metrics["train/gated_sequences"] = float((~keep).sum())
    metrics["reward/batch_mean"] = float(batch.rewards.mean())
    return metrics
