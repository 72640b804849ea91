"""The reward calling convention and its options helper.

A registered reward is a callable ``reward(response: str, task: dict, **options) -> float``
(the ``molt_register_rewards`` hookspec; plain or ``async``, per response or per group, see
:mod:`molt_core.rewards` for the whole v2 calling convention) carrying an ``Options``
attribute: the Pydantic model of its options. The recipe's ``[rewards.<name>]`` table, less
the reserved keys ``weight`` and ``timeout_s``, is passed as ``**options`` and validated
through ``Options`` on every call; ``check_options(name, reward, options)`` does
the same validation once, at start-up, so a bad recipe fails before any compute.

``response`` is only the model's reply (the completion), never the prompt. A reward that
cannot score (timeout, resource limit, crashing verifier) raises
:class:`molt_core.types.RewardFailed`; the runtime marks the trajectory ``failed``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["RewardOptions", "reward", "check_options", "validate_options"]


class RewardOptions(BaseModel):
    """Base options model of a reward (no fields; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")


def validate_options(model: type[BaseModel], options: dict[str, Any], where: str) -> BaseModel:
    """Validate ``options`` through ``model``.

    Raises:
        ValueError: listing every bad field as ``<where>.<field>: <problem>``.
    """
    try:
        return model.model_validate(options)
    except ValidationError as e:
        bad = "; ".join(f"{where}.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ValueError(f"invalid options: {bad}") from None


def reward(options: type[BaseModel] = RewardOptions, *, group: bool = False,
           isolation: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator turning ``fn(response, task, opts: options) -> float`` into a registered-reward
    callable ``fn(response, task, **options) -> float`` with ``.Options = options``.

    Reward API v2 (:mod:`molt_core.rewards`): ``fn`` may be ``async def`` (the wrapper is then
    async too and the runtime awaits it); with ``group=True`` it is a group reward
    ``fn(responses, tasks, opts) -> list[float]``; when ``fn`` has a ``trajectory`` parameter
    (group: ``trajectories``) the runtime passes the whole :class:`molt_core.rewards.Rollout`.
    ``isolation`` (``"thread"`` / ``"process"``) sets the reward's default ``molt_isolation``
    (see :mod:`molt_core.rewards`: use ``"process"`` for a reward that can sit in one long C
    call, e.g. a parser run on policy-written text; a recipe's ``isolation`` overrides it).
    Scores are returned as ``fn`` gave them, unconverted: the runtime accepts only real
    numbers (``"0.75"`` or ``None`` fail the trajectory ``not_a_number``, NaN / inf
    ``non_finite``) and, for a group, only a list / tuple / 1-d array of one score per response
    (a dict fails ``bad_output``); see :func:`molt_core.rewards.as_score`.

    Raises:
        ValueError: (when decorating) a bad ``isolation``; (when called) invalid options,
            naming ``rewards.<fn name>.<field>``.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        where = f"rewards.{fn.__name__}"
        key = "trajectories" if group else "trajectory"
        wants = key in inspect.signature(fn).parameters

        def split(kw: dict[str, Any]) -> tuple[BaseModel, dict[str, Any]]:
            extra = {key: kw.pop(key)} if wants and key in kw else {}
            return validate_options(options, kw, where), extra

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def wrapper(response: Any, task: Any, **kw: Any) -> Any:
                opts, extra = split(kw)
                return await fn(response, task, opts, **extra)
        else:
            @functools.wraps(fn)
            def wrapper(response: Any, task: Any, **kw: Any) -> Any:  # type: ignore[misc]
                opts, extra = split(kw)
                return fn(response, task, opts, **extra)

        wrapper.Options = options  # type: ignore[attr-defined]
        wrapper.molt_group = group  # type: ignore[attr-defined]
        wrapper.molt_trajectory = wants  # type: ignore[attr-defined]
        if isolation is not None:
            if isolation not in ("thread", "process"):
                raise ValueError(f"reward({fn.__name__}): isolation must be 'thread' or 'process', got {isolation!r}")
            wrapper.molt_isolation = isolation  # type: ignore[attr-defined]
        return wrapper

    return deco


def check_options(name: str, reward_fn: Any, options: dict[str, Any]) -> None:
    """Validate a recipe's ``[rewards.<name>]`` table against ``reward_fn.Options`` (if any);
    the reserved keys ``weight`` / ``timeout_s`` are checked by
    :func:`molt_core.rewards.reward_spec` and split off first.

    Raises:
        ValueError: naming ``rewards.<name>.<field>`` for each bad field.
    """
    from molt_core.rewards import reward_spec

    options = reward_spec(name, reward_fn, options).options
    model = getattr(reward_fn, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        validate_options(model, options, f"rewards.{name}")
