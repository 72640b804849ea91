"""The GAE critic: :class:`ValueModel`, its values before the update and its clipped value-loss update."""

from __future__ import annotations

import copy
from typing import Any

import torch

from molt_core.train.ingress import Batch

__all__ = ["ValueModel", "critic_values", "update_critic"]


class ValueModel(torch.nn.Module):
    """The critic of GAE: a copy of the policy's decoder with a zero-initialised scalar value head.

    ``forward(input_ids [B, T] int64) -> values [B, T] float32``, ``values[:, t]`` the value of the state
    *before* token ``t`` (from the hidden state at ``t - 1``; 0 at ``t = 0``), aligned with the logprobs.

    Raises:
        ValueError: the policy has no ``get_decoder()`` / ``config.hidden_size``.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        dec = policy.get_decoder() if hasattr(policy, "get_decoder") else None
        hidden = getattr(getattr(policy, "config", None), "hidden_size", None)
        if dec is None or hidden is None:
            raise ValueError(
                f"algo.advantage = 'gae' needs a critic built from the policy's decoder, but "
                f"{type(policy).__name__} has no get_decoder()/config.hidden_size; use a group estimator (grpo, rloo)"
            )
        self.backbone = copy.deepcopy(dec)
        self.head = torch.nn.Linear(int(hidden), 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state
        v = self.head(h).squeeze(-1).float()
        return torch.nn.functional.pad(v[:, :-1], (1, 0))


@torch.no_grad()
def critic_values(trainer: Any, batch: Batch) -> torch.Tensor:
    """The critic's values ``[B, T]`` float32 (CPU) before the update (see :class:`ValueModel`)."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows, real in trainer._work(batch, trainer.critic):
        Tr = int(batch.lengths[rows].max())
        with trainer.autocast():
            v = trainer.critic(batch.input_ids[rows, :Tr].to(trainer.device)).float().cpu()
        if real:
            out[rows, :Tr] = v
    return trainer._combine_rows(out)


def update_critic(trainer: Any, batch: Batch, old_values: torch.Tensor, returns: torch.Tensor,
                  train_mask: torch.Tensor, num_tokens: int) -> dict[str, float]:
    """``ppo_epochs`` critic steps on the clipped value loss (PPO; Schulman et al. 2017, arXiv 1707.06347,
    with value clipping as in OpenAI baselines ppo2): ``0.5 * max((V - G)^2, (V_old + clip(V - V_old,
    -c, c) - G)^2)`` summed over the action tokens / ``num_tokens`` (c = ``algo.value_clip``, None: no clip).

    ``old_values`` / ``returns`` ``[B, T]`` float32, ``train_mask`` ``[B, T]`` bool (CPU).
    Returns ``loss/value``, ``critic/grad_norm`` (before clipping), ``critic/value_mean``,
    ``critic/return_mean`` and ``critic/explained_variance`` (``1 - Var(G - V_old) / Var(G)``
    over the trained tokens, 0 when ``Var(G) = 0``)."""
    cfg = trainer.cfg
    c = cfg.algo.value_clip
    clip = cfg.trainer.grad_clip
    params = list(trainer.critic.parameters())
    loss_sum = gn_sum = 0.0
    for _epoch in range(cfg.trainer.ppo_epochs):
        trainer.critic_optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rows, real in trainer._work(batch, trainer.critic):
            active = real and bool(train_mask[rows].any())
            if not active and not trainer.lockstep:
                continue
            T = int(batch.lengths[rows].max())
            dev = trainer.device
            with trainer.autocast():
                v = trainer.critic(batch.input_ids[rows, :T].to(dev)).float()
            if not active:  # every process runs the same backwards (FSDP2 collectives)
                (0.0 * v.sum()).backward()
                continue
            g = returns[rows, :T].to(dev)
            err = (v - g) ** 2
            if c is not None:
                v0 = old_values[rows, :T].to(dev)
                err = torch.maximum(err, (v0 + (v - v0).clamp(-c, c) - g) ** 2)
            m = train_mask[rows, :T].to(dev)
            loss = 0.5 * torch.where(m, err, torch.zeros((), device=dev)).sum() / num_tokens
            loss.backward()
            total += float(loss.detach())
        gn = trainer._clip_grads(params, clip)
        trainer.critic_optimizer.step()
        loss_sum += trainer._reduce_losses({"loss/value": total})["loss/value"] / cfg.trainer.ppo_epochs
        gn_sum += gn / cfg.trainer.ppo_epochs
    m = train_mask
    g, v0 = returns[m].double(), old_values[m].double()
    var = float(g.var(unbiased=False)) if g.numel() > 1 else 0.0
    ev = 1.0 - float((g - v0).var(unbiased=False)) / var if var > 0 else 0.0
    return {"loss/value": loss_sum, "critic/grad_norm": gn_sum, "critic/value_mean": float(v0.mean()),
            "critic/return_mean": float(g.mean()), "critic/explained_variance": ev}
