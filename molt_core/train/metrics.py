"""The metrics of one :meth:`~molt_core.train.trainer.Trainer.train_step`.

The ingress metrics of :func:`molt_core.identity.screen`
(``invariants/tokens_retokenized``, ``invariants/tokens_unverified``,
``ingress/refused_retokenized``, ``ingress/refused_unverified``,
``ledger/context_reencoded_tokens``, ``ledger/rewrite_cause/<cause>``), ``ingress/refused_malformed``,
``ingress/refused_no_span``, ``ingress/refused_nonfinite`` (rollouts refused for a NaN /
infinite behaviour logprob at ingress, or a NaN / ``+inf`` logprob from a recompute of the
trainer before its update -- current-version and stale tokens alike: never counted as out of
support), ``invariants/nonfinite_logprobs`` (those rollouts' non-finite sampled tokens, 0 when
clean), ``ingress/refused_rollouts`` (all refusals; only these,
``train/skipped`` = 1, ``train/rollouts`` = 0 and ``train/step`` when nothing is
left to train on), ``invariants/logprob_absdiff_mean`` / ``_max`` (|behaviour - recomputed| over all
sampled in-support tokens, before the update: policy drift plus mismatch),
``invariants/logprob_absdiff_max_onpolicy`` / ``_mean_onpolicy`` (every step,
async included: each measured token against the weights of the version that
sampled it -- the proximal logprobs for the current version, a recompute under a
held older version otherwise; see :mod:`molt_core.train.version_history`; NaN when
nothing could be measured; finite: an on-policy token outside its own version's
support counts in ``invariants/onpolicy_out_of_support_tokens`` instead),
``invariants/onpolicy_tokens`` / ``_stale_tokens``,
for an MoE policy with recorded routing the R3 metrics of its routing tool
(:func:`molt_plugins.moe.routing_replay.routing_metrics`: ``invariants/routing_flip_rate``,
``invariants/routing_replay_mismatch``, ``_noreplay`` logprob variants),
``invariants/staleness_max`` (over every sampled token, before the gate; see
:func:`molt_core.algo.correction.apply_correction`), ``correction/*`` (incl.
``gated_frac`` and ``out_of_support_frac``), ``loss/*`` (``loss/total``,
``loss/policy``, ``loss/kl``, and the policy loss's own metrics), ``grad_norm``
(before clipping), ``kl`` (estimator ``algo.kl_estimator`` against the reference,
0 without one; over sampled tokens inside the reference's top-k / top-p support),
``kl/ref_out_of_support_frac`` (sampled tokens whose reference logprob is -inf --
outside the reference's support -- / sampled tokens: left out of the KL term in the
loss, the per-token reward and ``kl``), ``kl/behaviour_k3`` (current vs behaviour
policy), ``kl_coef``,
``distill/reverse_kl`` (``on_policy_distill`` only: the reverse KL
``KL(pi_student || pi_teacher)`` in nats per token, estimated on the student's
sampled tokens as the mean of ``log pi_student(y_t) - log pi_teacher(y_t)`` -- the
k1 estimator, Schulman 2020 -- before the update),
``entropy`` (mean over sampled tokens, nats, of the processed distribution),
``lr``, ``tokens_per_s`` (non-pad tokens / step wall time), ``train/*`` counts
(``train/fused_recompute`` 1 when the proximal logprobs came from the loss
forward; ``train/shared_prefix_frac`` the fraction of the loss forwards' token positions
(rows x columns) a shared prompt prefix saved, :func:`molt_core.train.forward.shared_prefix`
-- 0 when no micro-batch shared one), ``time/recompute`` (reference pass + separate recompute pass, if any),
``time/onpolicy_check`` (the copy of this version's weights kept for later steps'
check, plus the recompute under older versions -- or, when that overlaps the update
in a process of its own, the wait for it),
``time/train`` (loss forwards, backward, optimizer), ``time/step`` (seconds).
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
    if cfg.algo.advantage == "on_policy_distill":  # KL(student || teacher) on the student's own samples: k1
        metrics["distill/reverse_kl"] = float((prox - batch.teacher_logprobs)[mask].mean()) if n_sampled else 0.0
    keep = corr.keep.to(torch.bool)
    metrics["train/sequences"] = float(batch.size)
    metrics["train/rollouts"] = float(batch.rewards.numel())
    metrics["train/action_tokens"] = float(num_tokens)
    metrics["train/gated_sequences"] = float((~keep).sum())
    metrics["reward/batch_mean"] = float(batch.rewards.mean())
    return metrics
