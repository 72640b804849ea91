"""First-party environment plugins."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_envs(register):
    """Register the first-party environments."""
