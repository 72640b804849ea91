"""First-party metric loggers."""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_loggers(register):
    """Register the first-party loggers."""
