"""The policy update: the LR schedule, the loss over micro-batches with gradient accumulation,
the optimizer steps, and how micro-batch loss metrics combine."""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch

from molt_core.algo.kl import kl_loss
from molt_core.train.algorithms import policy_loss
from molt_core.train.ingress import Batch, nonfinite_check

__all__ = ["in_support", "lr_factor", "merge_loss_metrics", "policy_update"]


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the base LR for optimizer step ``step`` (0-based).

    Warmup is linear, ``(step + 1) / warmup_steps`` for ``step < warmup_steps`` (no step at LR 0);
    then, with ``p = (step - warmup) / max(1, total - warmup)`` clamped to [0, 1]: ``constant`` 1,
    ``linear`` ``1 - p``, ``cosine`` ``0.5 (1 + cos(pi p))`` (Loshchilov & Hutter 2017, SGDR, no restarts).

    Raises:
        ValueError: unknown schedule.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"trainer.lr_schedule {schedule!r} is unknown; use constant, linear or cosine")


def policy_update(trainer: Any, batch: Batch, prox: torch.Tensor | None, weights: torch.Tensor | None,
                  ref_lp: torch.Tensor | None, adv: torch.Tensor, train_mask: torch.Tensor, num_tokens: int,
                  correct: Callable[..., Any] | None, out_of_support: torch.Tensor | None = None,
                  kl_keep: torch.Tensor | None = None, before_step: Callable[[torch.Tensor | None], None] | None = None
                  ) -> tuple[dict[str, float], torch.Tensor | None, torch.Tensor | None]:
    """``ppo_epochs`` optimizer steps of ``trainer``'s policy over the batch's micro-batches.

    Per micro-batch: the registered loss (:func:`molt_core.train.algorithms.policy_loss`,
    normalised by the step's ``num_tokens``, so micro-batch losses sum) plus ``kl_coef *``
    :func:`molt_core.algo.kl.kl_loss` when KL is a loss term; then global grad-norm clip and one
    optimizer step per epoch. ``prox``, ``weights``, ``ref_lp``, ``adv``, ``out_of_support`` are
    ``[B, T]`` float32 / bool (CPU), ``train_mask`` ``[B, T]`` bool.

    With ``correct`` given (fused recompute), each micro-batch's proximal logprobs and IS weights come from
    its own epoch-0 loss forward via ``correct(prox_mb, rows)``; otherwise from ``weights`` and
    ``out_of_support``. ``kl_keep`` (``[B, T]`` bool, None: all) marks the tokens the KL term covers.
    ``before_step(prox)`` runs once, after epoch 0's backwards and before the first optimizer step, with the
    fused ``[B, T]`` proximal logprobs (None when not fused): whatever it raises leaves the weights untouched.

    Not fused, a loss forward's NaN / ``+inf`` logprob on a trained token in a later epoch is kept
    out of that epoch's backward; at the epoch's end the weights and AdamW state are restored to
    before the first optimizer step (a CPU copy per step when ``ppo_epochs > 1``) and
    :class:`~molt_core.train.ingress.NonFiniteLogprobs` is raised.

    Returns:
        ``(loss metrics averaged over epochs, prox [B, T] or None, entropy [B, T] or None)``
        -- the last two only when fused.
    """
    cfg = trainer.cfg
    clip = cfg.trainer.grad_clip
    dev = trainer.device
    fused = correct is not None
    B, Tfull = batch.input_ids.shape
    if fused:
        prox = torch.zeros((B, Tfull), dtype=torch.float32)
        ent_all = torch.zeros((B, Tfull), dtype=torch.float32)
    sums: dict[str, float] = {}
    saved: list[tuple[Any, torch.Tensor, dict[str, Any]]] | None = None  # before the first optimizer step
    for _epoch in range(cfg.trainer.ppo_epochs):
        trainer.optimizer.zero_grad(set_to_none=True)
        bad = None if fused else torch.zeros((B, Tfull), dtype=torch.float32)  # NaN / +inf trained tokens
        tot = pol = klv = 0.0
        extra: dict[str, float] = {}
        for rows, real in trainer._work(batch):
            active = real and bool(train_mask[rows].any())
            if not active and not (fused and real) and not trainer.lockstep:
                continue
            with torch.set_grad_enabled(active or trainer.lockstep):
                lp, ent = trainer._forward(trainer.model, batch, rows, with_entropy=fused)
            T = lp.shape[1]
            if fused and real and _epoch == 0:
                prox[rows, :T] = lp.detach().float().cpu()
                ent_all[rows, :T] = ent.cpu()
            if bad is not None and real:
                d = lp.detach().cpu()
                bad[rows, :T] = ((torch.isnan(d) | (d == math.inf)) & train_mask[rows, :T]).float()
            if not active:
                if trainer.lockstep:  # every process runs the same backwards (FSDP2 collectives)
                    (0.0 * torch.nan_to_num(lp, neginf=0.0).sum()).backward()
                continue
            if fused:  # a NaN / +inf stands in as -inf here; before_step refuses its rollout
                p_mb = prox[rows, :T]
                c = correct(torch.where(torch.isnan(p_mb) | (p_mb == math.inf), -math.inf, p_mb), rows)
                w, oos = c.weights, c.out_of_support
            else:
                w, oos = weights[rows, :T], out_of_support[rows, :T]
            # an out-of-support token (logprob -inf) stays out of the gradient (weight 0, finite
            # stand-ins so no NaN reaches backward) but counts in num_tokens under trunc/clip; a
            # later epoch may push a token out of support too (a NaN / +inf one: ``bad`` refuses it)
            oos = oos.to(dev) | ~torch.isfinite(lp.detach())
            m = train_mask[rows, :T].to(dev) & ~oos
            lp = torch.where(oos, torch.zeros((), device=dev), lp)
            p_mb = torch.where(oos, torch.zeros((), device=dev), prox[rows, :T].to(dev))
            loss, lm = policy_loss(cfg.algo, lp, p_mb, adv[rows, :T].to(dev), m, w.to(dev), num_tokens, trainer.algo.loss_fn)
            pol += float(loss.detach())
            merge_loss_metrics(extra, lm, int(m.sum()) / num_tokens)
            if ref_lp is not None and not cfg.algo.kl_as_reward and trainer.kl_coef > 0:
                km = m if kl_keep is None else m & kl_keep[rows, :T].to(dev)
                kl_term = kl_loss(lp, ref_lp[rows, :T].to(dev), km, num_tokens, cfg.algo.kl_estimator)
                klv += float(kl_term.detach())
                loss = loss + trainer.kl_coef * kl_term
            tot += float(loss.detach())
            loss.backward()
        if bad is not None and bool((bad := trainer._combine_rows(bad)).any()):  # every process alike
            if saved is not None:
                _restore(trainer, saved)
            nonfinite_check(torch.where(bad > 0, math.nan, 0.0), batch, f"the loss forward of PPO epoch {_epoch}")
        if _epoch == 0:
            if fused:  # every row, on every process, before anything reads them
                prox, ent_all = trainer._combine_rows(prox), trainer._combine_rows(ent_all)
            if before_step is not None:
                before_step(prox if fused else None)
            if cfg.trainer.ppo_epochs > 1:
                saved = _snapshot(trainer)
        gn = trainer._clip_grads(trainer.params, clip)
        trainer.optimizer.step()
        ep = {(k if k.startswith("loss/") else f"loss/{k}"): v for k, v in extra.items()}
        ep.update({"loss/total": tot, "loss/policy": pol, "loss/kl": klv})
        ep = trainer._reduce_losses(ep)
        ep["grad_norm"] = gn
        for k, v in ep.items():
            sums[k] = sums.get(k, 0.0) + v / cfg.trainer.ppo_epochs
    return sums, (prox if fused else None), (ent_all if fused else None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t`` (an FSDP2 ``DTensor``'s local shard, a view), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(trainer: Any) -> list[tuple[Any, torch.Tensor, dict[str, Any]]]:
    """``(parameter, values, optimizer state)`` of ``trainer.params``, copied to CPU, for :func:`_restore`."""
    def cpu(v: Any) -> Any:
        return _local(v.detach()).to("cpu", copy=True) if torch.is_tensor(v) else copy.deepcopy(v)

    state = trainer.optimizer.state
    return [(p, cpu(p), {k: cpu(v) for k, v in state[p].items()} if p in state else {}) for p in trainer.params]


@torch.no_grad()
def _restore(trainer: Any, saved: list[tuple[Any, torch.Tensor, dict[str, Any]]]) -> None:
    """Put back the parameters and optimizer state :func:`_snapshot` copied (and no state where none was)."""
    state = trainer.optimizer.state
    for p, w, st in saved:
        _local(p.detach()).copy_(w)
        if not st:
            state.pop(p, None)
        for k, v in st.items():
            if torch.is_tensor(v):
                _local(state[p][k]).copy_(v)
            else:
                state[p][k] = v


def in_support(prox: torch.Tensor | None, beh: torch.Tensor, oos: torch.Tensor) -> torch.Tensor | None:
    """``prox`` ``[B, T]`` with the behaviour logprob on out-of-support tokens ``oos`` (``[B, T]``
    bool), for consumers that need finite values (advantages, KL, metrics); None passes through."""
    return None if prox is None else torch.where(oos, beh, prox)


def merge_loss_metrics(acc: dict[str, float], mb: dict[str, float], share: float) -> None:
    """Fold one micro-batch's policy-loss metrics into ``acc``: ``*_min``/``*_max`` by min/max, loss
    and token count by sum, per-token means weighted by its ``share`` of the step's action tokens."""
    for k, v in mb.items():
        v = float(v)
        if k.endswith("_min"):
            acc[k] = min(acc.get(k, v), v)
        elif k.endswith("_max"):
            acc[k] = max(acc.get(k, v), v)
        elif k in ("loss/pg", "loss/tokens"):
            acc[k] = acc.get(k, 0.0) + v
        else:
            acc[k] = acc.get(k, 0.0) + v * share
