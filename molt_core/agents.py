"""Agents: the two forms a user's program takes, and where tasks come from.

* :class:`Env` -- Gymnasium-aligned. The framework owns the LLM loop: it renders
  ``reset(task)``'s observation as a user message, samples a reply through the ledger, calls
  ``step(action_text, state)`` and repeats until ``terminated`` / ``truncated`` or a token
  budget runs out. Rewards are summed over turns.
* :class:`ChatAgent` -- the user owns the loop: ``async run(ctx)`` talks to the stock OpenAI
  or Anthropic SDK pointed at ``ctx.openai_base_url`` / ``ctx.anthropic_base_url`` with
  ``ctx.api_key``; the loopback server records every turn token-exactly. The agent does not
  know it is in an RL run.

Both draw tasks from ``tasks(split, seed)``: an iterator of JSON-able dicts (``split`` is
``"train"`` or ``"eval"``; the eval split must be disjoint from training).
Options: set ``Options`` to a Pydantic model; the recipe's ``[agent.options]`` table is
validated through it and passed as ``self.options``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from molt_core.types import Result, SamplingParams

__all__ = ["AgentOptions", "Agent", "Env", "ChatAgent", "EpisodeState", "AgentContext", "make_agent"]


class AgentOptions(BaseModel):
    """Base options model of an agent (no fields); subclasses add theirs."""

    model_config = ConfigDict(extra="forbid")


class Agent:
    """Common base of :class:`Env` and :class:`ChatAgent`: options and the task source."""

    Options: ClassVar[type[BaseModel]] = AgentOptions

    def __init__(self, **options: Any) -> None:
        try:
            self.options = self.Options.model_validate(options)
        except ValidationError as e:
            bad = "; ".join(f"agent.options.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise ValueError(f"{type(self).__name__}: invalid options: {bad}") from None

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Yield task dicts for ``split`` (``"train"`` endless or long, ``"eval"`` finite).

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
    """Gymnasium-aligned environment; the framework owns the LLM loop.

    Override :meth:`reset` and :meth:`step`. ``system_prompt`` (class attribute or option)
    is sent as a system message when set.
    """

    system_prompt: ClassVar[str | None] = None

    def reset(self, task: dict[str, Any]) -> str:
        """Return the first observation (the user message text) for ``task``."""
        raise NotImplementedError

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Consume the model's reply ``action_text``; return the turn's :class:`Result`
        (``observation`` is the next user message when not terminated)."""
        raise NotImplementedError


@dataclass
class AgentContext:
    """What a :class:`ChatAgent` gets: the task, base URLs for both wires and the session's
    API key, the served ``model`` name and default sampling settings."""

    task: dict[str, Any]
    openai_base_url: str
    anthropic_base_url: str
    api_key: str
    model: str = "policy"
    sampling: SamplingParams = field(default_factory=SamplingParams)


class ChatAgent(Agent):
    """An agent program that owns its loop through a stock LLM SDK; override :meth:`run`."""

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
