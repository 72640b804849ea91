"""The run's advantage estimator and policy loss, resolved once from the plugin host's
registries, and the one place that reads the numbers of ``[algo]`` and ``[correction]`` and
hands them to the plain-tensor functions of :mod:`molt_core.algo`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from molt_core.algo.advantages import estimate_advantages, estimator_params
from molt_core.algo.builtins import ESTIMATORS, LOSSES
from molt_core.algo.correction import Correction, Gate, correct, staleness_gate
from molt_core.algo.losses import apply_policy_loss, loss_params
from molt_core.config import AlgoSection, ConfigError, CorrectionSection, RunConfig, group_baseline_check
from molt_core.plugins import PluginHost, load_plugins, unknown_name

__all__ = ["Algorithms", "resolve_algorithms", "compute_advantages", "policy_loss", "apply_correction", "correct_tokens"]


@dataclass(frozen=True)
class Algorithms:
    """The estimator and loss a run uses, and what the estimator's signature asks of the trainer.

    Attributes:
        advantage, loss: the registered names. estimator, loss_fn: the registered functions.
        needs_critic: the estimator names ``values`` (a GAE-style critic is built).
        needs_teacher: it names ``teacher_logprobs`` (teacher logprobs at ingress).
        needs_proximal: it names ``student_logprobs`` (proximal logprobs before the loss: no fusing).
        group_baseline: it names ``group_index``. token_rewards: it names ``token_rewards``.
    """

    advantage: str
    estimator: Callable[..., Any]
    loss: str
    loss_fn: Callable[..., Any]
    needs_critic: bool
    needs_teacher: bool
    needs_proximal: bool
    group_baseline: bool
    token_rewards: bool


def resolve_algorithms(cfg: RunConfig, host: PluginHost | None = None) -> Algorithms:
    """Look ``algo.advantage`` and ``algo.loss`` up in the registries (the names' one
    validation) and check the options the estimator's signature depends on.

    Args:
        cfg: the run config. host: the plugin host; None builds one from ``cfg.plugins`` and entry points.

    Raises:
        ConfigError: an unregistered name (listing the registered ones); a function whose signature
            the dispatcher cannot fill; ``algo.kl_as_reward`` with an estimator that takes no
            ``token_rewards``; a group baseline with ``rollout.n_samples_per_prompt < 2``.
    """
    host = load_plugins(cfg.plugins) if host is None else host
    a = cfg.algo
    found = {}
    for kind, option, name in (("estimators", "algo.advantage", a.advantage), ("losses", "algo.loss", a.loss)):
        try:
            found[kind] = host.get(kind, name)
        except KeyError as e:
            raise ConfigError(f"{option} = {name!r}: {e.args[0]}") from None
    try:
        params = estimator_params(found["estimators"])
        loss_params(found["losses"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    algos = Algorithms(a.advantage, found["estimators"], a.loss, found["losses"], "values" in params,
                       "teacher_logprobs" in params, "student_logprobs" in params, "group_index" in params,
                       "token_rewards" in params)
    if a.kl_as_reward and not algos.token_rewards:
        takers = [n for n in host.names("estimators") if "token_rewards" in estimator_params(host.get("estimators", n))]
        raise ConfigError(
            f"algo.kl_as_reward = true works with an algo.advantage that takes per-token rewards "
            f"({' or '.join(map(repr, takers))}), not {a.advantage!r}; set algo.kl_as_reward = false to use KL as a "
            f"loss term")
    if algos.group_baseline and found["estimators"] is not ESTIMATORS.get(a.advantage):  # built-ins: at load
        group_baseline_check(a.advantage, cfg.rollout.n_samples_per_prompt)
    return algos


def _builtin(kind: str, name: str) -> Callable[..., Any]:
    """A built-in estimator or loss by name, for callers without a host (tests, notebooks)."""
    reg = ESTIMATORS if kind == "estimators" else LOSSES
    if name not in reg:
        raise ValueError(unknown_name(kind, name, list(reg)))
    return reg[name]


def compute_advantages(cfg: AlgoSection, rewards: Tensor, group_index: Tensor, rollout_index: Tensor, mask: Tensor,
                       *, values: Tensor | None = None, token_rewards: Tensor | None = None,
                       student_logprobs: Tensor | None = None, teacher_logprobs: Tensor | None = None,
                       estimator: Callable[..., Any] | None = None) -> tuple[Tensor, Tensor | None]:
    """Advantages from the estimator ``cfg.advantage`` with the numbers of ``[algo]``.
    Returns ``(advantages [B, T] float32, returns [B, T] float32 or None)``.

    Args:
        cfg: ``[algo]`` (``advantage``, ``gamma``, ``lam``, ``adv_eps``, ``std_tol``, ``distill_coef``).
        rewards, group_index, rollout_index, mask, values, token_rewards, student_logprobs,
            teacher_logprobs: see :func:`molt_core.algo.advantages.estimate_advantages`.
        estimator: the registered function (:attr:`Algorithms.estimator`); None: the built-in.

    Raises:
        ValueError: as :func:`~molt_core.algo.advantages.estimate_advantages`; an unknown name.
    """
    fn = _builtin("estimators", cfg.advantage) if estimator is None else estimator
    return estimate_advantages(fn, rewards, group_index, rollout_index, mask, values=values,
                               token_rewards=token_rewards, student_logprobs=student_logprobs,
                               teacher_logprobs=teacher_logprobs, gamma=cfg.gamma, lam=cfg.lam, eps=cfg.adv_eps,
                               std_tol=cfg.std_tol, coef=cfg.distill_coef, name=cfg.advantage)


def policy_loss(cfg: AlgoSection, logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                is_weights: Tensor, num_tokens: int, loss_fn: Callable[..., Any] | None = None
                ) -> tuple[Tensor, dict[str, float]]:
    """Policy loss ``cfg.loss`` of one micro-batch with the clip band of ``[algo]``.
    Returns ``(scalar loss, metrics)`` as :func:`~molt_core.algo.losses.apply_policy_loss`.

    Args:
        cfg: ``[algo]`` (``loss``, ``clip_low``, ``clip_high``, ``dual_clip``).
        logprobs, proximal_logprobs, advantages, mask, is_weights, num_tokens: see
            :func:`molt_core.algo.losses.apply_policy_loss` (``[B, T]``; an int).
        loss_fn: the registered function (:attr:`Algorithms.loss_fn`); None: the built-in.

    Raises:
        ValueError: as :func:`~molt_core.algo.losses.apply_policy_loss`; an unknown name.
    """
    fn = _builtin("losses", cfg.loss) if loss_fn is None else loss_fn
    return apply_policy_loss(fn, logprobs, proximal_logprobs, advantages, mask, is_weights, num_tokens,
                             clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip)


def apply_correction(cfg: CorrectionSection, behaviour_logprobs: Tensor, versions: Tensor, proximal_logprobs: Tensor,
                     mask: Tensor, current_version: int, max_staleness: int, seq_index: Tensor | None = None
                     ) -> Correction:
    """Staleness gate, then :func:`correct_tokens`, in one call (for callers outside a train step).
    Returns a :class:`~molt_core.algo.correction.Correction`.

    Args:
        cfg: ``[correction]``. behaviour_logprobs, proximal_logprobs: ``[B, T]`` float.
        versions: ``[B, T]`` long. mask: ``[B, T]`` bool. current_version, max_staleness: ints.
        seq_index: ``[B]`` long or None. See :func:`molt_core.algo.correction.staleness_gate`.

    Raises:
        ValueError: as ``staleness_gate`` and ``correct``.
    """
    gate = staleness_gate(versions, mask, current_version, max_staleness, seq_index)
    return correct_tokens(cfg, gate, behaviour_logprobs, proximal_logprobs, mask)


def correct_tokens(cfg: CorrectionSection, gate: Gate, behaviour_logprobs: Tensor, proximal_logprobs: Tensor,
                   mask: Tensor) -> Correction:
    """Importance correction behind the step's ``gate`` with the band of ``[correction]``.
    Returns a :class:`~molt_core.algo.correction.Correction`.

    Args:
        cfg: ``[correction]`` (``is_level``, ``is_mode``, ``low``, ``high``).
        gate: the step's :func:`~molt_core.algo.correction.staleness_gate` (or a micro-batch's
            :meth:`~molt_core.algo.correction.Gate.rows`).
        behaviour_logprobs, proximal_logprobs: ``[B, T]`` float. mask: ``[B, T]`` bool.

    Raises:
        ValueError: as :func:`molt_core.algo.correction.correct`.
    """
    return correct(gate, behaviour_logprobs, proximal_logprobs, mask, is_level=cfg.is_level, is_mode=cfg.is_mode,
                   low=cfg.low, high=cfg.high)
