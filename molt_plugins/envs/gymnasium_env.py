"""``gymnasium`` env: a registered text ``gymnasium.Env`` id as a molt :class:`Env`.

A thin, typed front for :func:`molt_core.agents.from_gymnasium` so a recipe can name any
registered id (``FrozenLake-v1`` with ``render_mode = "ansi"``, or a third party's text env).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from molt_core.agents import GymnasiumEnv, from_gymnasium

__all__ = ["GymnasiumOptions", "GymnasiumTextEnv"]


class GymnasiumOptions(BaseModel):
    """Options of the ``gymnasium`` env.

    * ``env_id`` -- a registered gymnasium id; ``make_kwargs`` -- passed to ``gymnasium.make``
      (e.g. ``{render_mode = "ansi"}`` to observe a toy-text env's board as text).
    * ``action_names`` -- for a ``Discrete`` action space, the words the model replies with
      (index order); without them the reply must be the action's integer.
    * ``eval_size`` -- held-out eval episodes (seeds disjoint from training).
    * ``invalid_action_reward`` -- reward of a turn whose reply is not a valid action.
    * ``system_prompt`` -- optional system message (e.g. the rules and the action words).
    * ``imports`` -- modules imported first (a third-party package that registers its ids).
    """

    model_config = ConfigDict(extra="forbid")

    env_id: str
    make_kwargs: dict[str, Any] = Field(default_factory=dict)
    action_names: list[str] | None = None
    eval_size: int = Field(64, ge=1)
    invalid_action_reward: float = 0.0
    system_prompt: str | None = None
    imports: list[str] = Field(default_factory=list)


class GymnasiumTextEnv(GymnasiumEnv):
    """The registered ``gymnasium`` env (see :class:`molt_core.agents.GymnasiumEnv`).

    Raises (at construction):
        ValueError: invalid options, or ``env_id`` is not registered / ``make_kwargs`` are
            rejected by ``gymnasium.make`` (the message names the field).
    """

    Options = GymnasiumOptions
    molt_requires = ("gymnasium",)
    """Optional modules it imports (``molt plugins`` names the extra when one is missing)."""
    molt_example = {"options": {"env_id": "FrozenLake-v1", "make_kwargs": {"render_mode": "ansi"}, "eval_size": 4}}
    """Options for ``molt plugins --check`` (``env_id`` has no default)."""

    def __init__(self, **options: Any) -> None:
        from pydantic import ValidationError

        try:
            o = GymnasiumOptions.model_validate(options)
        except ValidationError as e:
            bad = "; ".join(f"agent.options.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ValueError(f"{type(self).__name__}: invalid options: {bad}") from None
        import importlib

        for mod in o.imports:
            importlib.import_module(mod)
        try:
            proto = from_gymnasium(o.env_id, make_kwargs=o.make_kwargs, action_names=o.action_names)
        except Exception as e:
            raise ValueError(
                f"agent.options.env_id = {o.env_id!r} (make_kwargs {o.make_kwargs}) cannot be made: "
                f"{type(e).__name__}: {e}"
            ) from None
        super().__init__(proto._make, action_names=o.action_names, eval_size=o.eval_size,
                         invalid_action_reward=o.invalid_action_reward, system_prompt=o.system_prompt, options=options)
