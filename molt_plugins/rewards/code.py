"""Code execution reward: run the response's code against the task's tests in the sandbox."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import RewardOptions, reward
from molt_plugins.sandbox import run_python

__all__ = ["extract_code", "code_tests", "CodeTestsOptions"]

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str, which: Literal["last_block", "first_block", "raw"] = "last_block") -> str:
    """The code of ``response``: the last (or first) fenced ```` ```python ```` block, or the whole
    response when it has no fenced block or ``which == "raw"``."""
    if which == "raw":
        return response
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    return blocks[-1] if which == "last_block" else blocks[0]


class CodeTestsOptions(RewardOptions):
    """Options of :func:`code_tests`.

    * ``tests_field`` -- task key holding test code (asserts) run after the solution.
    * ``tests_template`` -- instead of ``tests_field``: a ``str.format`` template over the
      task's fields, e.g. ``"{test}\ncheck({entry_point})"`` for HumanEval-style tasks.
    * ``prefix_field`` -- optional task key whose text is put before the solution (e.g. a
      function signature the response completes).
    * ``extract`` -- ``last_block`` / ``first_block`` fenced code block, or ``raw``.
    * ``timeout_s`` (wall seconds), ``memory_mb`` (address-space cap) -- sandbox limits.
    * ``limit_exceeded`` -- ``fail`` (default): a timeout, memory or output-limit kill
      raises :class:`RewardFailed` and the trajectory is excluded; ``zero``: it scores 0.0.
    """

    tests_field: str = "tests"
    tests_template: str | None = None
    prefix_field: str | None = None
    extract: Literal["last_block", "first_block", "raw"] = "last_block"
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(1024, ge=16)
    limit_exceeded: Literal["fail", "zero"] = "fail"


@reward(CodeTestsOptions)
def code_tests(response: str, task: dict[str, Any], opts: CodeTestsOptions) -> float:
    """1.0 when ``prefix + code + "\\n" + tests`` exits 0 in the sandbox, 0.0 when it exits
    non-zero (a failing assert, an exception, a syntax error).

    Raises:
        KeyError: the task has no ``tests_field`` (or ``prefix_field``).
        RewardFailed: ``timeout`` / ``memory`` / ``output_limit`` when the program hits a
            sandbox limit (unless ``limit_exceeded = "zero"``); ``crash`` when the sandbox
            could not start.
    """
    for f in (None if opts.tests_template else opts.tests_field, opts.prefix_field):
        if f is not None and f not in task:
            raise KeyError(f"code_tests needs task[{f!r}]; the task has {sorted(task)}")
    if opts.tests_template:
        try:
            tests = opts.tests_template.format(**task)
        except (KeyError, IndexError) as e:
            raise KeyError(f"rewards.code_tests.tests_template refers to {e}, not a field of the task {sorted(task)}") from None
    else:
        tests = str(task[opts.tests_field])
    code = extract_code(response, opts.extract)
    prefix = str(task[opts.prefix_field]) if opts.prefix_field else ""
    program = f"{prefix}{code}\n\n{tests}\n"
    try:
        res = run_python(program, timeout_s=opts.timeout_s, memory_mb=opts.memory_mb)
    except OSError as e:
        raise RewardFailed("crash", f"sandbox could not start: {e}") from e
    if res.status == "ok":
        return 1.0
    if res.status == "error":
        return 0.0
    if opts.limit_exceeded == "zero":
        return 0.0
    raise RewardFailed(res.status, res.reason())
