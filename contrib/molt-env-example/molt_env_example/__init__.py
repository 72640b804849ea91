"""Example third-party environment plugin for molt-sdk: ``reverse_word``.

The model sees ``Reverse: <word>`` and must reply with the word spelled backwards. It shows
the whole Env contract -- an ``Options`` model, ``tasks(split, seed)`` with a disjoint eval
split, ``reset(task) -> str`` and ``step(action_text, state) -> Result`` -- in one file::

    [agent]
    name = "reverse_word"
    [agent.options]
    min_len = 3
    max_len = 5
"""

from __future__ import annotations

import random
import string
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt_core.agents import EpisodeState, Env
from molt_core.hookspecs import hookimpl
from molt_core.types import Result

__all__ = ["ReverseWordOptions", "ReverseWordEnv", "molt_register_envs"]


class ReverseWordOptions(BaseModel):
    """``min_len`` / ``max_len`` -- word lengths; ``eval_size`` -- held-out words."""

    model_config = ConfigDict(extra="forbid")

    min_len: int = Field(3, ge=1)
    max_len: int = Field(5, ge=1)
    eval_size: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "ReverseWordOptions":
        if self.max_len < self.min_len:
            raise ValueError(f"max_len ({self.max_len}) must be >= min_len ({self.min_len})")
        return self


class ReverseWordEnv(Env):
    """Single-turn env: reward 1.0 when the reply (stripped) is the word reversed, else 0.0."""

    Options = ReverseWordOptions

    def _word(self, rng: random.Random) -> str:
        n = rng.randint(self.options.min_len, self.options.max_len)
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """``eval``: ``eval_size`` words from ``Random(seed)``; ``train``: endless words from
        ``Random(seed + 1)``, skipping every eval word (so the splits are disjoint)."""
        rng = random.Random(seed)
        held_out = [self._word(rng) for _ in range(self.options.eval_size)]
        if split == "eval":
            for w in held_out:
                yield {"word": w, "answer": w[::-1]}
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng, skip = random.Random(seed + 1), set(held_out)
        while True:
            w = self._word(rng)
            if w not in skip:
                yield {"word": w, "answer": w[::-1]}

    def reset(self, task: dict[str, Any]) -> str:
        """The prompt ``Reverse: <word>``."""
        return f"Reverse: {task['word']}"

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Grade the reply; the episode ends."""
        r = 1.0 if action_text.strip() == state.task["answer"] else 0.0
        return Result(reward=r, score=r, terminated=True)


@hookimpl
def molt_register_envs(register):
    """Register ``reverse_word``."""
    register("reverse_word", ReverseWordEnv)
