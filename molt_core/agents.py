"""Agents, the two forms a user's program takes: an :class:`Env` (the framework owns the LLM loop)
or a :class:`ChatAgent` (the program owns it, through a stock OpenAI or Anthropic SDK pointed at the
loopback server). Both draw tasks from ``tasks(split, seed)`` and take ``[agent.options]`` through
their ``Options`` model; :func:`from_gymnasium` wraps a text ``gymnasium.Env``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from molt_core.config import RunConfig, text_hint
from molt_core.plugins import PluginHost, import_path
from molt_core.types import Result, SamplingParams

__all__ = ["AgentOptions", "Agent", "Env", "ChatAgent", "EpisodeState", "AgentContext", "make_agent",
           "load_agent", "GymnasiumEnv", "from_gymnasium"]


class AgentOptions(BaseModel):
    """Base options model of an agent (no fields); subclasses add theirs."""

    model_config = ConfigDict(extra="forbid")


class Agent:
    """Common base of :class:`Env` and :class:`ChatAgent`: ``self.options`` (validated by the class's
    ``Options`` model) and the task source. ``repeat_train_split = False`` makes a run whose finite
    ``train`` split runs out stop with an error instead of starting a new epoch."""

    Options: ClassVar[type[BaseModel]] = AgentOptions
    repeat_train_split: ClassVar[bool] = True

    def __init__(self, **options: Any) -> None:
        try:
            self.options = self.Options.model_validate(options)
        except ValidationError as e:
            bad = "; ".join(f"{w}: {x['msg']}{text_hint(w, x)}"
                            for x in e.errors() for w in [f"agent.options.{'.'.join(map(str, x['loc']))}"])
            raise ValueError(f"{type(self).__name__}: invalid options: {bad}") from None

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Yield JSON-able task dicts for ``split``: ``"train"`` (long) or ``"eval"`` (finite, disjoint).

        Raises:
            NotImplementedError: the agent does not provide tasks.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define tasks(split, seed)")


@dataclass
class EpisodeState:
    """Per-episode state the Env runner hands to ``step``: the task, the 0-based turn index,
    the chat ``messages`` so far (OpenAI format) and a free ``scratch`` dict for the env."""

    task: dict[str, Any]
    turn: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    scratch: dict[str, Any] = field(default_factory=dict)


class Env(Agent):
    """Gymnasium-aligned environment: the framework sends ``reset(task)`` as a user message, samples a
    reply, calls ``step(reply, state)`` and repeats until ``terminated`` / ``truncated`` or the token
    budget runs out, summing rewards. Override :meth:`reset` and :meth:`step`."""

    system_prompt: ClassVar[str | None] = None

    def reset(self, task: dict[str, Any]) -> str:
        """Return the first observation (the user message text) for ``task``."""
        raise NotImplementedError

    def first_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The first chat messages for ``task`` (the Env runner's and SFT's): ``system_prompt`` (an
        ``options.system_prompt`` wins), if any, then ``reset(task)``; override for several."""
        messages: list[dict[str, Any]] = []
        sp = getattr(getattr(self, "options", None), "system_prompt", None) or self.system_prompt
        if sp:
            messages.append({"role": "system", "content": sp})
        messages.append({"role": "user", "content": self.reset(task)})
        return messages

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Consume the model's reply ``action_text``; return the turn's :class:`Result`
        (``observation`` is the next user message when not terminated)."""
        raise NotImplementedError


@dataclass
class AgentContext:
    """What a :class:`ChatAgent` gets: the task, both wires' base URLs, the session's API key, the
    served ``model`` name and default sampling settings."""

    task: dict[str, Any]
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str = "policy"
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams())


class ChatAgent(Agent):
    """An agent program that owns its loop through a stock LLM SDK (every turn recorded by the
    loopback server); override :meth:`run`."""

    async def run(self, ctx: AgentContext) -> Result:
        """Run one episode of ``ctx.task`` and return its :class:`Result` (reward set)."""
        raise NotImplementedError


def make_agent(obj: Any, options: dict[str, Any]) -> Agent:
    """Instantiate a registered agent: a class (``Env``/``ChatAgent`` subclass) or a factory.

    Raises:
        TypeError: the result is neither an ``Env`` nor a ``ChatAgent``.
        ValueError: invalid options (names each field).
    """
    agent = obj(**options)
    if not isinstance(agent, (Env, ChatAgent)):
        raise TypeError(f"{obj!r} produced {type(agent).__name__}, expected an Env or ChatAgent subclass")
    return agent


#: gymnasium reset seeds: train ``seed + i`` for ``i <`` this, eval ``seed + GYM_EVAL_SEED_OFFSET + i``
GYM_EVAL_SEED_OFFSET = 1_000_000_007


_ANSI_SPAN = re.compile(r"\x1b\[[0-9;]*m(.*?)\x1b\[0m", re.DOTALL)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _default_obs_to_text(obs: Any, env: Any) -> str:
    """The default ``obs_to_text`` (see :func:`from_gymnasium`)."""
    if isinstance(obs, str):
        return obs
    if getattr(env, "render_mode", None) == "ansi":
        return _ANSI.sub("", _ANSI_SPAN.sub(r"[\1]", str(env.render())))
    return str(obs)


def _default_text_to_action(text: str, env: Any, action_names: list[str] | None = None) -> Any:
    from gymnasium import spaces

    space = env.action_space
    t = text.strip()
    if isinstance(space, spaces.Text):
        if not space.contains(t):
            raise ValueError(f"{t!r} is not in the action space {space}")
        return t
    if isinstance(space, spaces.Discrete):
        if action_names:
            low = [a.lower() for a in action_names]
            if t.lower() in low:
                return space.start + low.index(t.lower())
            raise ValueError(f"{t!r} is not one of the actions {action_names}")
        try:
            a = int(t)
        except ValueError:
            raise ValueError(f"{t!r} is not an integer action in {space}") from None
        if not space.contains(a):
            raise ValueError(f"{a} is outside the action space {space}")
        return a
    raise ValueError(f"cannot map text to an action of {space}; pass text_to_action=")


class GymnasiumEnv(Env):
    """An :class:`Env` over a text ``gymnasium.Env`` (built by :func:`from_gymnasium`); tasks are
    ``{"seed": int}``, each episode a fresh ``make()`` env reset with that seed. A reply that is no
    valid action costs a turn, scores ``invalid_action_reward`` and is told why."""

    def __init__(self, make: Callable[[], Any], obs_to_text: Callable[[Any, Any], str] | None = None,
                 text_to_action: Callable[[str, Any], Any] | None = None, action_names: list[str] | None = None,
                 eval_size: int = 64, invalid_action_reward: float = 0.0, system_prompt: str | None = None,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(**(options or {}))
        self._make = make
        self._obs_to_text = obs_to_text or _default_obs_to_text
        self._text_to_action = text_to_action or (lambda text, env: _default_text_to_action(text, env, action_names))
        self.eval_size = eval_size
        self.invalid_action_reward = invalid_action_reward
        if system_prompt is not None:
            self.system_prompt = system_prompt  # type: ignore[misc]  # an instance override of the class default

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """``{"seed": s}`` dicts: ``"train"`` endless from ``seed``, ``"eval"`` ``eval_size`` of them.

        Raises:
            ValueError: unknown split.
        """
        if split == "eval":
            for i in range(self.eval_size):
                yield {"seed": seed + GYM_EVAL_SEED_OFFSET + i}
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        i = 0
        while i < GYM_EVAL_SEED_OFFSET:
            yield {"seed": seed + i}
            i += 1

    def reset(self, task: dict[str, Any]) -> str:
        """First observation (text) of the episode seeded ``task["seed"]``."""
        env = self._make()
        try:
            obs, _ = env.reset(seed=task.get("seed"))
            return self._obs_to_text(obs, env)
        finally:
            env.close()

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Apply the reply as an action; see the class docstring."""
        env = state.scratch.get("gym_env")
        if env is None:
            env = self._make()
            env.reset(seed=state.task.get("seed"))
            state.scratch["gym_env"] = env
        try:
            action = self._text_to_action(action_text, env)
        except ValueError as e:
            return Result(reward=self.invalid_action_reward, observation=f"Invalid action: {e}. Try again.",
                          info={"invalid_action": True})
        obs, reward, terminated, truncated, info = env.step(action)
        done = bool(terminated or truncated)
        text = None if done else self._obs_to_text(obs, env)
        if done:
            env.close()
            state.scratch.pop("gym_env", None)
        plain = {k: v for k, v in (info or {}).items() if isinstance(v, (str, int, float, bool)) or v is None}
        return Result(reward=float(reward), observation=text, terminated=bool(terminated), truncated=bool(truncated),
                      info=plain)


def from_gymnasium(env: Any, *, make_kwargs: dict[str, Any] | None = None,
                   obs_to_text: Callable[[Any, Any], str] | None = None,
                   text_to_action: Callable[[str, Any], Any] | None = None,
                   action_names: list[str] | None = None, eval_size: int = 64,
                   invalid_action_reward: float = 0.0, system_prompt: str | None = None) -> GymnasiumEnv:
    """Wrap a text ``gymnasium.Env`` as an :class:`Env`.

    Args:
        env: an env id (``gymnasium.make(env, **make_kwargs)`` per episode), a zero-argument
            factory, or an env instance (deep-copied per episode).
        obs_to_text: ``(obs, env) -> str``; default: a string observation, else an ``ansi``
            ``env.render()`` (colour removed, highlights as ``[X]``), else ``str(obs)``.
        text_to_action: ``(reply, env) -> action`` raising ``ValueError``; default: the stripped
            text (``Text`` space), an integer or a name of ``action_names`` (``Discrete``).
        eval_size: number of held-out eval episodes; invalid_action_reward: reward of a turn
            whose reply is not an action; system_prompt: optional system message.

    Raises:
        gymnasium.error.Error: ``env`` is an unknown id (here, not at the first rollout).
        TypeError: ``env`` is none of the accepted kinds.
    """
    import copy

    import gymnasium

    if isinstance(env, str):
        kw = dict(make_kwargs or {})
        gymnasium.make(env, **kw).close()  # fail now on an unknown id or bad kwargs

        def make() -> Any:
            return gymnasium.make(env, **kw)
    elif isinstance(env, gymnasium.Env):
        proto = env

        def make() -> Any:
            return copy.deepcopy(proto)
    elif callable(env):
        make = env
    else:
        raise TypeError(f"from_gymnasium: expected an env id, a gymnasium.Env or a factory, got {type(env).__name__}")
    return GymnasiumEnv(make, obs_to_text=obs_to_text, text_to_action=text_to_action, action_names=action_names,
                        eval_size=eval_size, invalid_action_reward=invalid_action_reward, system_prompt=system_prompt)


def load_agent(cfg: RunConfig, host: PluginHost) -> Agent:
    """Instantiate the run's agent, ``agent.name`` (registered) or ``agent.path`` (a ``.py`` file
    defining ``agent``, an instance or factory, or exactly one Env / ChatAgent subclass).

    Raises:
        ValueError: naming the field: not exactly one of ``agent.name`` / ``agent.path``, an unknown
            name, a missing or non-``.py`` file, a failed import, no agent or several, bad options.
    """
    a = cfg.agent
    if bool(a.name) == bool(a.path):
        raise ValueError("set exactly one of agent.name (a registered env, see `molt plugins`) or agent.path (a .py file) / --agent")
    if a.name:
        try:
            obj = host.get("envs", a.name)
        except KeyError as e:
            raise ValueError(f"agent.name: {e.args[0]}") from None
        return make_agent(obj, a.options)
    path = str(a.path)
    if not Path(path).is_file():
        raise ValueError(f"agent.path: no such file {a.path!r}")
    if Path(path).suffix != ".py":
        raise ValueError(f"agent.path {a.path!r}: not a .py file; give a Python file defining an Env or ChatAgent")
    try:
        mod = import_path(path, prefix="molt_agent")
    except Exception as e:  # the user's file: report its error in one line, before any compute
        raise ValueError(f"agent.path {a.path!r}: importing it failed: {type(e).__name__}: {e}") from e
    modname = mod.__name__
    if hasattr(mod, "agent"):
        obj = mod.agent
        if isinstance(obj, (Env, ChatAgent)):
            return obj
        return make_agent(obj, a.options)
    found = [v for v in vars(mod).values()
             if isinstance(v, type) and issubclass(v, (Env, ChatAgent)) and v not in (Env, ChatAgent)
             and v.__module__ == modname]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"agent.path {a.path!r} must define `agent` or exactly one Env/ChatAgent subclass (found {names})")
    return make_agent(found[0], a.options)
