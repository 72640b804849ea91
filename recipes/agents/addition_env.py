"""An Env written from scratch: 2-digit addition over two turns (answer, then confirm).

Turn 1: "What is A + B?" -> the model answers. Turn 2: "Say it again." -> the model repeats.
Reward: 0.5 for each turn whose reply is the right number (the framework sums turns).
"""

from __future__ import annotations

import random

from molt_core.agents import Env, EpisodeState
from molt_core.types import Result


class TwoTurnAddition(Env):
    """Two-turn addition; tasks are ``{"question", "answer"}`` dicts."""

    def tasks(self, split, seed):
        rng = random.Random(seed + (0 if split == "train" else 1_000_003))
        for _ in range(10**9 if split == "train" else 64):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield {"question": f"What is {a} + {b}?", "answer": str(a + b)}

    def reset(self, task):
        return task["question"]

    def step(self, action_text: str, state: EpisodeState) -> Result:
        right = action_text.strip() == state.task["answer"]
        if state.turn == 0:
            return Result(reward=0.5 * right, observation="Say it again.")
        return Result(reward=0.5 * right, terminated=True, score=1.0 if right else 0.0)
