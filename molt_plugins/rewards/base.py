"""The reward calling convention and its options helper.

A registered reward is a callable ``reward(response: str, task: dict, **options) -> float``
(the ``molt_register_rewards`` hookspec) carrying an ``Options`` attribute: the Pydantic
model of its options. The recipe's ``[rewards.<name>]`` table is passed as ``**options`` and
validated through ``Options`` on every call; ``check_options(name, reward, options)`` does
the same validation once, at start-up, so a bad recipe fails before any compute.

``response`` is only the model's reply (the completion), never the prompt. A reward that
cannot score (timeout, resource limit, crashing verifier) raises
:class:`molt_core.types.RewardFailed`; the runtime marks the trajectory ``failed``.
"""

from __future__ import annotations

import functools
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


def reward(options: type[BaseModel] = RewardOptions) -> Callable[[Callable[..., float]], Callable[..., float]]:
    """Decorator turning ``fn(response, task, opts: options) -> float`` into a registered-reward
    callable ``fn(response, task, **options) -> float`` with ``.Options = options``."""

    def deco(fn: Callable[..., float]) -> Callable[..., float]:
        where = f"rewards.{fn.__name__}"

        @functools.wraps(fn)
        def wrapper(response: str, task: dict[str, Any], **kw: Any) -> float:
            opts = validate_options(options, kw, where)
            return float(fn(response, task, opts))

        wrapper.Options = options  # type: ignore[attr-defined]
        return wrapper

    return deco


def check_options(name: str, reward_fn: Any, options: dict[str, Any]) -> None:
    """Validate a recipe's ``[rewards.<name>]`` table against ``reward_fn.Options`` (if any).

    Raises:
        ValueError: naming ``rewards.<name>.<field>`` for each bad field.
    """
    model = getattr(reward_fn, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        validate_options(model, options, f"rewards.{name}")
