"""``arithmetic`` env: the quickstart's addition problems, built in (no reasoning-gym needed).

The problems are those of reasoning-gym's ``basic_arithmetic`` task (Apache-2.0,
https://github.com/open-thought/reasoning-gym) for the configurations without parentheses and
with ``+`` / ``-`` only: item ``i`` of the dataset seeded ``s`` is drawn from
``random.Random(s + i)`` in the same order -- the number of terms, the number of digits ``d``,
each term uniform in ``0..10**d`` (both ends included), then one operator per gap -- and its
answer is the left-to-right value. The task dicts (prompt, answer, metadata), the train
order, the held-out split and the scorer are those of the ``reasoning_gym`` env
(:mod:`molt_plugins.envs.reasoning_gym`), whose machinery this env reuses; a recipe switches
between the two by its ``[agent] name`` alone and gets the same run.
``tests/test_env_arithmetic.py`` checks both against reasoning-gym itself, item by item.

Scoring is reasoning-gym's default verifier: 1.0 for the exact answer, partial credit
``len(answer) / len(reply)`` when the answer is a substring of the reply, else 0.0 (an empty or
missing reply scores 0.0).
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt_plugins.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymOptions

__all__ = ["ArithmeticConfig", "ArithmeticOptions", "ArithmeticEnv", "AdditionProblems", "default_score"]

TASK = "basic_arithmetic"


class ArithmeticConfig(BaseModel):
    """The problem generator's fields (the recipe's ``[agent.options.config]``), named and
    defaulted as reasoning-gym's ``basic_arithmetic`` config.

    * ``min_terms`` / ``max_terms`` -- terms per expression, drawn uniformly (both included).
    * ``min_digits`` / ``max_digits`` -- digits ``d`` per expression; every term is drawn from
      ``0..10**d`` (so ``d = 2`` gives 0 to 100).
    * ``operators`` -- a non-empty list of ``"+"`` and ``"-"`` (required: reasoning-gym's
      default also has ``*`` and ``/``, which this env does not build).
    * ``allow_parentheses`` -- must be ``false`` (required, as above).
    * ``allow_negation`` -- accepted for compatibility; without parentheses it changes nothing.
    * ``format_style`` -- ``"simple"`` only: the task's own question reads ``"Calculate <expr>."``.
    """

    model_config = ConfigDict(extra="forbid")

    min_terms: int = Field(2, ge=1)
    max_terms: int = Field(6, ge=1)
    min_digits: int = Field(1, ge=1)
    max_digits: int = Field(4, ge=1)
    operators: list[Literal["+", "-"]] = Field(min_length=1)
    allow_parentheses: Literal[False]
    allow_negation: bool = True
    format_style: Literal["simple"] = "simple"

    @model_validator(mode="after")
    def _ranges(self) -> "ArithmeticConfig":
        """Refuse an empty range (``max_terms < min_terms`` or ``max_digits < min_digits``)."""
        for lo, hi in (("min_terms", "max_terms"), ("min_digits", "max_digits")):
            if getattr(self, hi) < getattr(self, lo):
                raise ValueError(f"{hi} ({getattr(self, hi)}) must be >= {lo} ({getattr(self, lo)})")
        return self


class ArithmeticOptions(ReasoningGymOptions):
    """Options of the ``arithmetic`` env (the recipe's ``[agent.options]``): those of the
    ``reasoning_gym`` env, with ``task`` fixed to ``"basic_arithmetic"``, ``config`` holding
    ``min_terms``, ``max_terms``, ``min_digits``, ``max_digits``, ``operators`` (``+`` / ``-``,
    required), ``allow_parentheses`` (``false``, required) and ``allow_negation``, and no
    ``answer_tag`` (the reply is scored whole)."""

    task: Literal["basic_arithmetic"] = TASK
    config: ArithmeticConfig  # type: ignore[assignment]
    answer_tag: None = None


def default_score(answer: str | None, gold: str) -> float:
    """reasoning-gym's default verifier: 1.0 when ``answer == gold``; ``len(gold) /
    len(answer)`` when ``gold`` occurs inside ``answer``; 0.0 otherwise, and for ``None`` or
    ``""``."""
    if not isinstance(answer, str) or not answer:
        return 0.0
    if answer == gold:
        return 1.0
    return len(gold) / len(answer) if gold in answer else 0.0


class AdditionProblems:
    """The ``size`` problems of generator seed ``seed`` (see the module docstring); indexable
    like a reasoning-gym dataset, with its ``score_answer``."""

    def __init__(self, config: ArithmeticConfig, seed: int, size: int) -> None:
        self.config, self.seed, self.size = config, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Item ``index``: ``{"question", "answer", "metadata"}`` (metadata: ``source_dataset``,
        ``source_index``, ``expression``, ``num_terms``, ``num_digits``, ``difficulty``).

        Raises:
            IndexError: ``index`` outside ``0..size-1``.
        """
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} is outside 0..{self.size - 1}")
        c = self.config
        rng = random.Random(self.seed + index)
        n_terms = rng.randint(c.min_terms, c.max_terms)
        n_digits = rng.randint(c.min_digits, c.max_digits)
        terms = [rng.randint(0, 10**n_digits) for _ in range(n_terms)]
        ops = [rng.choice(c.operators) for _ in range(n_terms - 1)]
        value, words = terms[0], [str(terms[0])]
        for op, t in zip(ops, terms[1:]):
            value = value + t if op == "+" else value - t
            words += [op, str(t)]
        expression = " ".join(words)
        return {
            "question": f"Calculate {expression}.",
            "answer": str(value),
            "metadata": {
                "source_dataset": TASK, "source_index": index, "expression": expression,
                "num_terms": n_terms, "num_digits": n_digits,
                "difficulty": {"num_terms": (c.min_terms, c.max_terms), "num_digits": (c.min_digits, c.max_digits)},
            },
        }

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        """:func:`default_score` of ``answer`` against ``entry["answer"]``."""
        return default_score(answer, entry["answer"])


class ArithmeticEnv(ReasoningGymEnv):
    """Single-turn +/- arithmetic, built in: reasoning-gym's basic_arithmetic problems.

    The ``reasoning_gym`` env's splits, prompts, scoring and rewards over :class:`AdditionProblems`.

    Raises (at construction):
        ValueError: invalid options (names the field, e.g. ``agent.options.config.operators.0``).
    """

    Options = ArithmeticOptions
    molt_example = {"options": {"size": 16, "eval_size": 4,
                                "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
                                           "operators": ["+"], "allow_parentheses": False}}}
    """Options for ``molt plugins --check`` (``config`` has required fields)."""
    molt_requires: tuple[str, ...] = ()

    def _check_task(self) -> None:
        """Nothing to import: the task is built in."""

    def _create(self, seed: int, size: int) -> AdditionProblems:
        """The problems of generator seed ``seed``, ``size`` of them."""
        return AdditionProblems(self.options.config, seed, size)
