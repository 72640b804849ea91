"""Code execution reward: run the response's code against the task's tests in the sandbox.

Graded on a positive signal only: the tests run in their own process, which never runs the
solution's code (every solution name is a proxy to the solution's process, values cross as
plain data), and writes a per-run random token only after the tests' last statement returned
(:attr:`molt_plugins.sandbox.SandboxResult.tests_completed`). An exit status of 0 never passes
(issue 11: ``sys.exit(0)`` after a wrong solution scored 1.0) and no exit status, signal,
stderr line or output flood of the solution turns its 0.0 into a failure. See
``docs/plugins/code_tests.md`` for what a hostile solution can still do.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import RewardOptions, reward
from molt_plugins.sandbox import RETURN_MARGIN_S, run_python

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
    * ``timeout_s`` (wall seconds), ``memory_mb`` (address-space cap) -- sandbox limits. In a
      recipe the runtime's bound on the reward call is ``timeout_s +
      sandbox.RETURN_MARGIN_S`` (``molt_timeout``), never the sandbox limit itself.
    * ``limit_exceeded`` -- what a run the supervisor saw pass its time limit (wall deadline,
      or the measured CPU time at ``RLIMIT_CPU``) scores: ``zero`` (default) 0.0, like any
      other run whose tests did not complete; ``fail`` raises :class:`RewardFailed`
      ``timeout`` and the trajectory is excluded from training. ``fail`` lets a policy trade
      a 0.0 for an exclusion by looping or blocking until the deadline; use it only where
      slow infrastructure, not the policy, is the likely cause. Memory and output limits are
      never a failure (only the program itself reports them): 0.0.
    """

    tests_field: str = "tests"
    tests_template: str | None = None
    prefix_field: str | None = None
    extract: Literal["last_block", "first_block", "raw"] = "last_block"
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(1024, ge=16)
    limit_exceeded: Literal["fail", "zero"] = "zero"


def grade_tests(solution: str, tests: str, *, timeout_s: float, memory_mb: int,
                limit_exceeded: Literal["fail", "zero"] = "zero", keep_names: tuple[str, ...] = (),
                label: str = "") -> float:
    """1.0 when ``tests`` ran to completion against ``solution`` in the sandbox (the tests
    process returned the run's token, :attr:`SandboxResult.tests_completed`), else 0.0. Shared
    by ``code_tests`` and the ``humaneval`` env.

    Graded only on signals the solution cannot forge: the token (held by a tests process the
    solution's code never runs in) and the supervisor's own clock. The solution's exit status,
    signals, stderr or output size never decide anything: ``sys.exit(86)``, a self-sent
    ``SIGXCPU``, ``raise MemoryError`` or a flood of output all score 0.0.

    Args:
        solution: program text run first (as ``main.py``), in its own process.
        tests: test code, run in a separate process against proxies of the solution's names.
        timeout_s: wall seconds; memory_mb: address-space cap (MiB) of each process.
        limit_exceeded: ``zero`` -- a run past its time limit scores 0.0; ``fail`` -- it raises.
        keep_names: solution names the tests must see even if they shadow a builtin.
        label: prefix of the failure message (e.g. a task id).

    Raises:
        RewardFailed: ``timeout`` with ``limit_exceeded = "fail"`` when the supervisor saw the
            time limit pass (``SandboxResult.timed_out``); ``crash`` when the sandbox cannot start.
    """
    try:
        res = run_python(solution, tests=tests, keep_names=keep_names, timeout_s=timeout_s, memory_mb=memory_mb)
    except OSError as e:
        raise RewardFailed("crash", f"sandbox could not start: {e}") from e
    if res.tests_completed:
        return 1.0
    if res.timed_out and limit_exceeded == "fail":
        raise RewardFailed("timeout", f"{label}{': ' if label else ''}{res.reason()}")
    return 0.0


@reward(CodeTestsOptions)
def code_tests(response: str, task: dict[str, Any], opts: CodeTestsOptions) -> float:
    """1.0 when the task's tests run to completion after ``prefix + code`` in the sandbox (the
    harness's token, see :func:`grade_tests`), 0.0 otherwise (a failing assert, an exception, a
    syntax error, an exit of any status before the tests finished).

    Raises:
        KeyError: the task has no ``tests_field`` (or ``prefix_field``).
        RewardFailed: ``timeout`` when the supervisor saw the time limit pass and
            ``limit_exceeded = "fail"``; ``crash`` when the sandbox could not start.
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

# the runtime's bound on one call: the sandbox limit plus its start-up / kill margin, so that the
# runtime never cuts a run the sandbox would still have judged (a 0.97 s solution, timeout_s = 1)
code_tests.molt_timeout = lambda options: CodeTestsOptions.model_validate(options).timeout_s + RETURN_MARGIN_S  # type: ignore[attr-defined]
