"""Advantage estimators: one pure function each, and :func:`estimate_advantages` to call one.

Shapes: ``R`` rollouts (``rewards[r]`` float, ``group_index[r]`` long); ``B`` rows, one segment each,
a rollout's in order (``rollout_index[b]`` long in ``[0, R)``; ``mask[b, t]`` bool ``[B, T]``, True on
sampled tokens). Group estimators return one advantage per rollout, broadcast to its sampled tokens;
token estimators recurse over a rollout's sampled tokens, its reward on the last (docs/architecture.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "estimate_advantages",
    "estimator_params",
    "grpo",
    "dr_grpo",
    "rloo",
    "rloo_norm",
    "reinforce",
    "reinforce_baseline",
    "gae",
    "on_policy_distill",
    "broadcast_to_tokens",
]

_F64 = torch.float64


def _check_inputs(rewards: Tensor, group_index: Tensor, rollout_index: Tensor, mask: Tensor) -> None:
    """Validate the common arguments; raises ValueError naming the argument."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [R] (one reward per rollout), got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contains NaN or inf; give failed rollouts a finite reward or drop them")
    if group_index.shape != rewards.shape:
        raise ValueError(f"group_index must have shape [R]={tuple(rewards.shape)}, got {tuple(group_index.shape)}")
    if group_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"group_index must be an integer tensor, got {group_index.dtype}")
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool [B, T] tensor, got {mask.dtype} shape {tuple(mask.shape)}")
    if rollout_index.shape != (mask.shape[0],):
        raise ValueError(f"rollout_index must have shape [B]=({mask.shape[0]},), got {tuple(rollout_index.shape)}")
    if rollout_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rollout_index must be an integer tensor, got {rollout_index.dtype}")
    R = rewards.shape[0]
    if rollout_index.numel() and (int(rollout_index.min()) < 0 or int(rollout_index.max()) >= R):
        raise ValueError(f"rollout_index values must lie in [0, R={R}), got range "
                         f"[{int(rollout_index.min())}, {int(rollout_index.max())}]")


def _check_token_tensor(name: str, x: Tensor | None, mask: Tensor) -> Tensor:
    if x is None:
        raise ValueError(f"{name} is required by this advantage estimator")
    if x.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(x.shape)}")
    return x


def broadcast_to_tokens(per_rollout: Tensor, rollout_index: Tensor, mask: Tensor) -> Tensor:
    """Copy a per-rollout value to every sampled token of each of the rollout's segments.

    Args:
        per_rollout: ``[R]`` float. rollout_index: ``[B]`` long. mask: ``[B, T]`` bool, sampled tokens.

    Returns:
        ``[B, T]`` float32: ``per_rollout[rollout_index[b]]`` where ``mask``, else 0.
    """
    vals = per_rollout.to(torch.float32)[rollout_index.long()]  # [B]
    return torch.where(mask, vals[:, None], torch.zeros((), dtype=torch.float32))


def _groups(group_index: Tensor) -> list[Tensor]:
    """Indices of the rollouts of each group (groups in sorted id order)."""
    return [torch.nonzero(group_index == g).flatten() for g in torch.unique(group_index)]


def _std(x: Tensor, tol: float, unbiased: bool) -> float:
    """Standard deviation of 1-D float64 ``x`` (two-pass), 0.0 when below ``tol`` or undefined."""
    n = x.numel()
    if n < (2 if unbiased else 1):
        return 0.0
    dev = x - x.mean()
    s = float(torch.sqrt((dev * dev).sum() / (n - 1 if unbiased else n)))
    return 0.0 if s < tol else s


def grpo(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6, std_tol: float = 1e-6) -> Tensor:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, eq. in §4.1.2).

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the **sample** std (ddof=1).
    A singleton group, or a group whose std (float64) is below ``std_tol``, gets exactly 0.

    Args:
        rewards: ``[R]`` float, one reward per rollout. group_index: ``[R]`` long, its group.
        eps: added to the std. std_tol: a std below it counts as zero spread.

    Returns:
        ``[R]`` float64 advantages.
    """
    r = rewards.to(_F64)
    out = torch.zeros_like(r)
    for idx in _groups(group_index):
        x = r[idx]
        s = _std(x, std_tol, unbiased=True)
        if s > 0.0:
            out[idx] = (x - x.mean()) / (s + eps)
    return out


def dr_grpo(rewards: Tensor, group_index: Tensor, *, std_tol: float = 1e-6) -> Tensor:
    """Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783).

    ``A_i = r_i - mean(r_group)``: GRPO without the std division (which biases towards too-easy/too-hard
    questions). A group whose std is below ``std_tol`` gets exactly 0. Returns ``[R]`` float64 advantages.
    """
    r = rewards.to(_F64)
    out = torch.zeros_like(r)
    for idx in _groups(group_index):
        x = r[idx]
        if _std(x, std_tol, unbiased=False) > 0.0:
            out[idx] = x - x.mean()
    return out


def _leave_one_out(x: Tensor, std_tol: float) -> tuple[Tensor, Tensor]:
    """Per element ``i`` of 1-D float64 ``x``: mean and sample std of the other elements
    (two-pass, so constant others give std exactly 0; 0 below ``std_tol`` or with < 2 others)."""
    n = x.numel()
    others = ~torch.eye(n, dtype=torch.bool)  # [n, n], row i = everyone but i
    vals = x[None, :].expand(n, n)
    cnt = n - 1
    mean = torch.where(others, vals, 0.0).sum(1) / cnt
    if cnt < 2:
        return mean, torch.zeros_like(mean)
    dev = torch.where(others, vals - mean[:, None], 0.0)
    std = torch.sqrt((dev * dev).sum(1) / (cnt - 1))
    return mean, torch.where(std < std_tol, torch.zeros_like(std), std)


def rloo(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO advantage (Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740; Kool et al. 2019).

    ``A_i = r_i - mean_{j != i}(r_j)``, the leave-one-out baseline. A singleton group gets 0.
    Returns ``[R]`` float64 advantages.
    """
    r = rewards.to(_F64)
    out = torch.zeros_like(r)
    for idx in _groups(group_index):
        if idx.numel() < 2:
            continue
        x = r[idx]
        out[idx] = x - (x.sum() - x) / (x.numel() - 1)
    return out


def rloo_norm(rewards: Tensor, group_index: Tensor, *, eps: float = 0.0, std_tol: float = 1e-6) -> Tensor:
    """Leave-one-out baseline with leave-one-out std normalisation.

    ``A_i = (r_i - mean_{j != i} r_j) / (std_{j != i} r_j + eps)`` with the sample std of the others; where
    that std is zero (fewer than two others, or below ``std_tol`` in float64) the advantage is **not** divided
    (docs/architecture.md). A singleton group gets 0. Returns ``[R]`` float64 advantages.
    """
    r = rewards.to(_F64)
    out = torch.zeros_like(r)
    for idx in _groups(group_index):
        if idx.numel() < 2:
            continue
        x = r[idx]
        mean, std = _leave_one_out(x, std_tol)
        dev = x - mean
        out[idx] = torch.where(std > 0, dev / (std + eps), dev)
    return out


def reinforce_baseline(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6, std_tol: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262, the group-baseline variant).

    ``A_i = r_i - mean(r_group)``, then ``A_i / (std_batch(A) + eps)`` with the population std of
    those ``A`` over all rollouts (whose mean is 0); a batch std below ``std_tol``: no division.
    Returns ``[R]`` float64 advantages.
    """
    a = dr_grpo(rewards, group_index, std_tol=std_tol)
    s = _std(a, std_tol, unbiased=False)
    return a / (s + eps) if s > 0.0 else a


def _rollout_order(rollout_index: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Flatten each rollout's sampled tokens in order (segments by row, tokens by position).

    Returns ``(flat_pos, roll, col, L)`` per sampled token, sorted stably by rollout: flat index
    into ``[B*T]``, rollout, position within the rollout's token sequence; ``L`` the longest length.
    """
    B, T = mask.shape
    flat_pos = torch.nonzero(mask.flatten()).flatten()  # row-major: (b, t) order
    roll = rollout_index.long()[flat_pos // T]
    roll, order = torch.sort(roll, stable=True)
    flat_pos = flat_pos[order]
    if flat_pos.numel() == 0:
        return flat_pos, roll, flat_pos.clone(), 0
    counts = torch.bincount(roll)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(flat_pos.numel()) - starts[roll]
    return flat_pos, roll, col, int(counts.max())


def _discounted_reverse(x: Tensor, valid: Tensor, factor: float) -> Tensor:
    """``y[:, l] = x[:, l] + factor * y[:, l+1]`` over padded ``[N, L]`` float64 rows."""
    y = torch.zeros_like(x)
    nxt = torch.zeros(x.shape[0], dtype=x.dtype)
    for col in range(x.shape[1] - 1, -1, -1):
        nxt = torch.where(valid[:, col], x[:, col] + factor * nxt, nxt)
        y[:, col] = nxt
    return y


def _per_token_rewards(rewards: Tensor, rollout_index: Tensor, mask: Tensor,
                       token_rewards: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, int]]:
    """Padded per-rollout reward sequences ``[R, L]`` float64 and the flattening used."""
    flat_pos, roll, col, L = _rollout_order(rollout_index, mask)
    R = rewards.shape[0]
    rew = torch.zeros(R, L, dtype=_F64)
    if token_rewards is not None:
        rew[roll, col] = token_rewards.flatten().to(_F64)[flat_pos]
    if flat_pos.numel():
        last = torch.zeros(R, dtype=torch.long).scatter_reduce(0, roll, col, reduce="amax", include_self=False)
        has = torch.bincount(roll, minlength=R) > 0
        rr = torch.nonzero(has).flatten()
        rew[rr, last[rr]] += rewards.to(_F64)[rr]
    return rew, (flat_pos, roll, col, L)


def _scatter_back(padded: Tensor, flat: tuple[Tensor, Tensor, Tensor, int], mask: Tensor) -> Tensor:
    flat_pos, roll, col, _ = flat
    out = torch.zeros(mask.numel(), dtype=torch.float32)
    out[flat_pos] = padded[roll, col].to(torch.float32)
    return out.view(mask.shape)


def reinforce(rewards: Tensor, rollout_index: Tensor, mask: Tensor, *, gamma: float = 1.0,
              token_rewards: Tensor | None = None, eps: float = 1e-6, std_tol: float = 1e-6) -> Tensor:
    """REINFORCE++ advantage (Hu et al. 2025, arXiv 2501.03262): whitened discounted return.

    Per-token reward ``rew_t = token_rewards_t + [t is the rollout's last sampled token] * r``;
    return ``G_t = sum_{k >= t} gamma^(k-t) rew_k`` over the rollout's sampled tokens in order;
    whitened over the batch's sampled tokens, ``A_t = (G_t - mean(G)) / (std(G) + eps)``
    (population std; below ``std_tol`` only centred).

    Args:
        rewards: ``[R]`` float. rollout_index: ``[B]`` long. mask: ``[B, T]`` bool.
        gamma: discount per sampled token.
        token_rewards: optional ``[B, T]`` float per-token reward (e.g. ``-kl_coef * kl``).

    Returns:
        ``[B, T]`` float32, 0 where ``mask`` is False.
    """
    rew, flat = _per_token_rewards(rewards, rollout_index, mask, token_rewards)
    valid = torch.zeros_like(rew, dtype=torch.bool)
    valid[flat[1], flat[2]] = True
    ret = _discounted_reverse(rew, valid, gamma)
    g = ret[flat[1], flat[2]]
    if g.numel():
        s = _std(g, std_tol, unbiased=False)
        g = (g - g.mean()) / (s + eps) if s > 0.0 else g - g.mean()
        ret[flat[1], flat[2]] = g
    return _scatter_back(ret, flat, mask)


def gae(rewards: Tensor, rollout_index: Tensor, mask: Tensor, values: Tensor, *, gamma: float = 1.0,
        lam: float = 1.0, token_rewards: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv 1506.02438, eq. 16).

    Over a rollout's sampled tokens in order, ``rew_t`` as in :func:`reinforce`: ``delta_t = rew_t
    + gamma * V_{t+1} - V_t`` (``V`` = 0 after the last token), ``A_t = delta_t + gamma * lam *
    A_{t+1}`` (not whitened), and returns ``G_t = A_t + V_t`` (the critic's regression target).

    Args:
        values: ``[B, T]`` float, the critic's value at each token (read on sampled tokens).

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` float32, 0 where ``mask`` is False.
    """
    rew, flat = _per_token_rewards(rewards, rollout_index, mask, token_rewards)
    flat_pos, roll, col, L = flat
    v = torch.zeros_like(rew)
    v[roll, col] = values.detach().flatten().to(_F64)[flat_pos]
    valid = torch.zeros_like(rew, dtype=torch.bool)
    valid[roll, col] = True
    v_next = torch.zeros_like(v)
    if L > 1:
        v_next[:, :-1] = torch.where(valid[:, 1:], v[:, 1:], 0.0)
    delta = rew + gamma * v_next - v
    adv = _discounted_reverse(delta, valid, gamma * lam)
    return _scatter_back(adv, flat, mask), _scatter_back(adv + v, flat, mask)


def on_policy_distill(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, coef: float = 1.0) -> Tensor:
    """On-policy distillation advantage: ``A_t = -coef * (log pi_student(y_t) - log pi_teacher(y_t))``,
    the per-token reverse-KL signal on the student's own samples, no baseline (Agarwal et al. 2024,
    GKD, arXiv 2306.13649; Thinking Machines 2025 "On-Policy Distillation").

    Args:
        student_logprobs, teacher_logprobs: ``[B, T]`` float, logprob of the sampled token.

    Returns:
        ``[B, T]`` float32, 0 where ``mask`` is False.
    """
    a = -coef * (student_logprobs.detach().to(_F64) - teacher_logprobs.detach().to(_F64))
    return torch.where(mask, a, 0.0).to(torch.float32)


#: The tensors an estimator may name (``[B, T]`` float, or None when the step has none), and
#: the numbers (``gamma``, ``lam`` floats in [0, 1]; ``eps``, ``std_tol`` floats >= 0; ``coef``
#: float). Every estimator takes ``rewards``-style arguments by keyword, naming only those it uses.
TOKEN_INPUTS = ("token_rewards", "values", "student_logprobs", "teacher_logprobs")
INPUTS = ("rewards", "group_index", "rollout_index", "mask", *TOKEN_INPUTS)
NUMBERS = ("gamma", "lam", "eps", "std_tol", "coef")


def estimator_params(estimator: Callable[..., Any]) -> dict[str, bool]:
    """``{parameter: required}`` of a registered estimator (required = no default).

    Raises:
        ValueError: a parameter that is neither in :data:`INPUTS` nor in :data:`NUMBERS`
            (the dispatcher could not fill it), or a ``*args`` / ``**kwargs`` parameter.
    """
    out: dict[str, bool] = {}
    for p in inspect.signature(estimator).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name not in (*INPUTS, *NUMBERS):
            raise ValueError(f"advantage estimator {getattr(estimator, '__name__', estimator)!r} takes {p.name!r}; "
                             f"an estimator names only parameters from {', '.join((*INPUTS, *NUMBERS))}")
        out[p.name] = p.default is inspect.Parameter.empty
    return out


def estimate_advantages(
    estimator: Callable[..., Any],
    rewards: Tensor,
    group_index: Tensor,
    rollout_index: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    student_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    std_tol: float = 1e-6,
    coef: float = 1.0,
    name: str = "?",
) -> tuple[Tensor, Tensor | None]:
    """Advantages of every sampled token from a registered ``estimator`` (calling convention:
    :func:`molt_core.hookspecs.molt_register_estimators`), which receives by keyword only the
    arguments its signature names: a tensor it requires must be given, a given ``token_rewards`` taken.

    Args:
        estimator: the registered function. rewards: ``[R]`` float32, one per rollout.
        group_index: ``[R]`` long. rollout_index: ``[B]`` long, rollout of each row (segment).
        mask: ``[B, T]`` bool, sampled tokens. values, token_rewards, student_logprobs,
            teacher_logprobs: ``[B, T]`` float or None.
        gamma, lam, eps, std_tol, coef: the numbers estimators may take (``algo.gamma``,
            ``algo.lam``, ``algo.adv_eps``, ``algo.std_tol``, ``algo.distill_coef``).
        name: the estimator's registered name, for errors.

    Returns:
        ``(advantages [B, T] float32, returns [B, T] float32 or None)``, 0 where ``mask`` is False:
        an ``[R]`` result is broadcast to each rollout's sampled tokens, a ``[B, T]`` one used as is,
        a pair is ``(advantages, returns)`` (returns train a critic).

    Raises:
        ValueError: malformed shapes/dtypes/indices (naming the argument), a missing input the
            estimator needs, or ``token_rewards`` given to an estimator that would ignore it.
    """
    _check_inputs(rewards, group_index, rollout_index, mask)
    params = estimator_params(estimator)
    given = {"rewards": rewards, "group_index": group_index, "rollout_index": rollout_index, "mask": mask,
             "values": values, "token_rewards": token_rewards, "student_logprobs": student_logprobs,
             "teacher_logprobs": teacher_logprobs,
             "gamma": gamma, "lam": lam, "eps": eps, "std_tol": std_tol, "coef": coef}
    if token_rewards is not None and "token_rewards" not in params:
        raise ValueError(f"token_rewards (KL as reward) is only used by an algo.advantage that takes them "
                         f"(built in: 'reinforce', 'gae'), not {name!r}; set algo.kl_as_reward=false or "
                         f"switch estimator")
    for k in TOKEN_INPUTS:
        if k in params and (params[k] or given[k] is not None):
            _check_token_tensor(k, given[k], mask)
    out = estimator(**{k: given[k] for k in params})
    if isinstance(out, tuple):
        return out
    if out.dim() == 1:
        return broadcast_to_tokens(out, rollout_index, mask), None
    return out, None
