"""First-party reward plugins."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl
from molt_plugins.rewards.basic import exact_match


@hookimpl
def molt_register_rewards(register):
    """Register ``exact_match``."""
    register("exact_match", exact_match)
