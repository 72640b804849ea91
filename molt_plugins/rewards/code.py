"""Code execution reward: run the response's code against the task's tests in the sandbox.

Graded on a positive signal only: the sandbox harness writes a per-run random token after the
tests' last statement returned (:attr:`molt_plugins.sandbox.SandboxResult.tests_completed`);
an exit status of 0 alone never passes (issue 11: ``sys.exit(0)`` after a wrong solution scored
1.0). See ``docs/plugins/code_tests.md`` for what a hostile solution can still do.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import RewardOptions, reward
from molt_plugins.sandbox import run_python

__all__ = ["extract_code", "code_tests", "CodeTestsOptions", "grade_tests"]

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


def grade_tests(solution: str, tests: str, *, timeout_s: float, memory_mb: int,
                limit_exceeded: Literal["fail", "zero"] = "fail", keep_names: tuple[str, ...] = (),
                label: str = "") -> float:
    """1.0 when ``tests`` ran to completion after ``solution`` in the sandbox (the harness
    returned the run's token), else 0.0. Shared by ``code_tests`` and the ``humaneval`` env.

    Args:
        solution: program text run first (as ``main.py``).
        tests: test code run after it, in its namespace with the builtins restored.
        timeout_s: wall seconds; memory_mb: address-space cap (MiB).
        limit_exceeded: ``fail`` -- a timeout / memory / output-limit kill raises; ``zero``.
        keep_names: solution names the tests must see even if they shadow a builtin.
        label: prefix of the failure message (e.g. a task id).

    Raises:
        RewardFailed: ``timeout`` / ``memory`` / ``output_limit`` (unless ``limit_exceeded =
            "zero"``) when the tests did not complete; ``crash`` when the sandbox cannot start.
    """
    try:
        res = run_python(solution, tests=tests, keep_names=keep_names, timeout_s=timeout_s, memory_mb=memory_mb)
    except OSError as e:
        raise RewardFailed("crash", f"sandbox could not start: {e}") from e
    if res.tests_completed:
        return 1.0
    if res.status in ("ok", "error") or limit_exceeded == "zero":
        return 0.0
    raise RewardFailed(res.status, f"{label}{': ' if label else ''}{res.reason()}")


@reward(CodeTestsOptions)
def code_tests(response: str, task: dict[str, Any], opts: CodeTestsOptions) -> float:
    """1.0 when the task's tests run to completion after ``prefix + code`` in the sandbox (the
    harness's token, see :func:`grade_tests`), 0.0 otherwise (a failing assert, an exception, a
    syntax error, an exit of any status before the tests finished).

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
    return grade_tests(f"{prefix}{code}\n", f"{tests}\n", timeout_s=opts.timeout_s, memory_mb=opts.memory_mb,
                       limit_exceeded=opts.limit_exceeded)

code_tests.molt_example = {  # type: ignore[attr-defined]  # molt plugins --check runs it twice
    "response": "```python\ndef add(a, b):\n    return a + b\n```", "task": {"tests": "assert add(2, 3) == 5"}}
