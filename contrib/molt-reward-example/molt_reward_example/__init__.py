"""Example third-party reward plugin for molt-sdk: ``brevity``.

Install it (``pip install molt-reward-example``, or ``pip install -e .`` here) and it appears
in ``molt plugins``; use it from a recipe with::

    [rewards.brevity]
    max_chars = 32
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from molt_core.hookspecs import hookimpl

__all__ = ["BrevityOptions", "brevity", "molt_register_rewards"]


class BrevityOptions(BaseModel):
    """``max_chars`` -- replies up to this many characters (after stripping) score 1.0;
    ``weight`` -- multiplies the score (use a small weight to add it to a task reward)."""

    model_config = ConfigDict(extra="forbid")

    max_chars: int = Field(64, ge=1)
    weight: float = 1.0


def brevity(response: str, task: dict[str, Any], **options: Any) -> float:
    """``weight * min(1, max_chars / len(response.strip()))``; 1.0 * weight for an empty reply.

    Example: ``max_chars=4``, reply ``"12345678"`` -> 0.5.

    Raises:
        ValueError: invalid options, naming ``rewards.brevity.<field>``.
    """
    try:
        o = BrevityOptions.model_validate(options)
    except ValidationError as e:
        bad = "; ".join(f"rewards.brevity.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise ValueError(f"invalid options: {bad}") from None
    n = len(response.strip())
    return o.weight * (1.0 if n <= o.max_chars else o.max_chars / n)


brevity.Options = BrevityOptions  # type: ignore[attr-defined]  # shown by `molt plugins`


@hookimpl
def molt_register_rewards(register):
    """Register ``brevity``."""
    register("brevity", brevity)
