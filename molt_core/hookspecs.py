"""The molt plugin API: pluggy hook specifications (entry-point group ``molt``).

A plugin is any module or object with functions decorated by :data:`hookimpl` whose names
are below. A hookimpl may accept fewer arguments than its spec (pluggy), so the API is
versioned by *adding* arguments and hooks, never changing them; :data:`HOOK_API_VERSION`
counts those additions.

Registration hooks receive a ``register(name, obj)`` callback rather than returning values,
so the host knows which plugin registered what and reports name collisions (pattern of
simonw/llm). Lifecycle hooks are broadcasts.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "molt"
HOOK_API_VERSION = 2
"""2: Reward API v2 -- async, group and trajectory rewards; ``weight`` / ``timeout_s`` per reward;
and ``molt_register_sandbox_backends``."""

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[[str, Any], None]


@hookspec
def molt_register_rewards(register: Register) -> None:
    """Register reward functions: ``register(name, fn_or_class)``.

    A reward is called as ``reward(response: str, task: dict, **options) -> float`` (or an
    object with that ``__call__``), where ``options`` is the recipe's ``[rewards.<name>]``
    table less the reserved keys ``weight`` and ``timeout_s``. API version 2 adds: ``async def``
    rewards (awaited), group rewards (``molt_group = True``: ``reward(responses, tasks,
    **options) -> list[float]``), and rewards given the whole rollout (a ``trajectory`` /
    ``trajectories`` parameter); see :mod:`molt_core.rewards`. Raising, running past
    ``timeout_s`` or returning a non-finite number marks the trajectory ``failed``.
    """


@hookspec
def molt_register_envs(register: Register) -> None:
    """Register agents: ``register(name, cls)`` where ``cls`` is an ``Env`` or ``ChatAgent``
    subclass (``molt_core.agents``), or a factory returning one."""


@hookspec
def molt_register_judges(register: Register) -> None:
    """Register LLM-as-judge scorers: ``register(name, cls)``."""


@hookspec
def molt_register_teachers(register: Register) -> None:
    """Register distillation teachers: ``register(name, cls)`` giving per-token teacher
    logprobs on the student's sampled tokens."""


@hookspec
def molt_register_replay_backends(register: Register) -> None:
    """Register MoE routing-replay (R3) backends: ``register(model_type, backend)``."""


@hookspec
def molt_register_engines(register: Register) -> None:
    """Register rollout engines: ``register(name, factory)`` returning a ``RolloutEngine``;
    the factory is called with :func:`molt_core.runtime.workers.engine_kwargs` (``device`` among
    them when ``engine.num_gpus > 0``)."""


@hookspec
def molt_register_loggers(register: Register) -> None:
    """Register metric loggers: ``register(name, cls)``; ``cls(run_dir, config, **options)``
    has ``log(step: int, metrics: dict[str, float])`` and ``close()``. ``options`` is the
    recipe's ``[loggers.<name>]`` table (empty for the list form ``loggers = ["<name>"]``),
    validated first by ``cls.Options`` (a Pydantic model) when the class declares one. A logger
    may also have ``log_samples(step: int, rows: list[dict])``: decoded rollouts, each
    ``{"prompt": str, "completion": str, "reward": float | None, "status": str}``, for
    trackers that show tables."""


@hookspec
def molt_register_sandbox_backends(register: Register) -> None:
    """Register code-sandbox backends: ``register(name, backend)`` where ``backend`` (or a
    zero-argument class building it) implements ``molt_plugins.sandbox.SandboxBackend``:
    ``available()``, ``describe()`` and ``run(SandboxRequest) -> SandboxResult`` -- e.g. a
    client of a remote sandbox service. Selected by ``MOLT_SANDBOX_BACKEND=<name>``."""


@hookspec
def molt_register_adapters(register: Register) -> None:
    """Register trainer adapters: ``register(name, adapter)``; ``[trainer.<name>]`` selects one
    (first party: ``lora``, :mod:`molt_plugins.lora`). The adapter provides, each taking the
    policy ``model`` (an ``nn.Module``):

    * ``wrap(model, options) -> nn.Module`` -- the policy the trainer trains (``options``: the
      ``[trainer.<name>]`` section); called once, before the optimizer sees the parameters;
    * ``reference(model) -> nn.Module`` -- the frozen KL reference (e.g. the adapter disabled);
    * ``merged_state_dict(model) -> dict[str, Tensor]`` -- plain weights under the base model's
      names, what engines load and ``model/`` of a checkpoint holds;
    * ``base_training(model)`` -- a context manager yielding ``(forward model, parameters)``
      the SFT warm start optimises;
    * ``save(model, d: Path)`` / ``load(model, d: Path)`` -- the adapter's checkpoint files in
      checkpoint directory ``d`` (``model/`` included); ``load`` raises ``FileNotFoundError``
      for a checkpoint it did not write.
    """


@hookspec
def molt_register_trainer_backends(register: Register) -> None:
    """Register data-parallel trainer backends: ``register(name, backend)``; ``fsdp2`` (first
    party, :mod:`molt_plugins.distributed`) runs ``trainer.world_size > 1``. The backend provides:

    * ``init_process_group(rank: int, world_size: int, init_method: str) -> str`` -- join the
      ranks' process group (``init_method``: a ``tcp://`` or ``file://`` rendezvous); returns
      the collective backend (``gloo`` / ``nccl``);
    * ``trainer(cfg: RunConfig) -> Trainer`` -- this rank's trainer (a ``Trainer`` subclass
      with ``rank``, ``world_size`` and ``backend``; its ``save_checkpoint`` writes the
      distributed checkpoint, every rank calling it);
    * ``load_checkpoint(trainer, d: Path)`` -- load the distributed checkpoint directory ``d``
      (``dcp/``) into any trainer, sharded at any world size or one plain ``Trainer``;
    * ``load_model(module, d: Path)`` / ``load_optimizer(module, optimizer, state: dict)`` -- a
      plain checkpoint's weight files / ``optimizer.state_dict()`` into a rank's sharded module.
    """


@hookspec(historic=True)
def molt_configure(config: Any) -> None:
    """Called once with the resolved ``RunConfig`` before any compute starts (historic:
    plugins registered later still receive it)."""


@hookspec
def molt_on_trajectory(trajectory: Any) -> None:
    """Called with each finished ``Trajectory`` (after rewards), before it is queued."""


@hookspec
def molt_on_step_end(step: int, metrics: dict) -> None:
    """Called after each optimizer step with the step's metrics (``dict[str, float]``)."""


REGISTRATION_HOOKS: dict[str, str] = {
    "rewards": "molt_register_rewards",
    "envs": "molt_register_envs",
    "judges": "molt_register_judges",
    "teachers": "molt_register_teachers",
    "replay_backends": "molt_register_replay_backends",
    "engines": "molt_register_engines",
    "loggers": "molt_register_loggers",
    "sandbox_backends": "molt_register_sandbox_backends",
    "adapters": "molt_register_adapters",
    "trainer_backends": "molt_register_trainer_backends",
}
