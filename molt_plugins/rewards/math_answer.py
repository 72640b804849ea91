"""Math answer grading: ``\\boxed{}`` extraction by balanced braces, equivalence by math-verify.

The final answer is the content of the textually *last* ``\\boxed{...}`` (or ``\\fbox{...}``),
or brace-less ``\\boxed 5`` (see :func:`extract_boxed`), of the response; braces are counted
(``\\{`` / ``\\}`` escapes are skipped), so nested groups survive: ``\\boxed{\\frac{1}{2}}``
gives ``\\frac{1}{2}``, not ``\\frac{1``. An unclosed last box (a truncated generation) gives
no answer at all. Equivalence of the extracted answer and the gold answer is decided by
Hugging Face ``math-verify`` (sympy based; https://github.com/huggingface/Math-Verify), not by
our own parser.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from pydantic import Field

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import RewardOptions, reward

__all__ = ["extract_boxed", "math_equal", "math_answer", "MathAnswerOptions"]

# ``\boxed`` / ``\fbox`` as a whole control word (not ``\boxedx``), then spaces and at most
# one line break (TeX reads those as one space; a blank line would be a paragraph).
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])[ \t]*(?:\n[ \t]*)?")
# A brace-less argument: one word -- an optional leading control word (``\frac``), then
# characters up to whitespace, ``$`` or the next backslash (``\]``, ``\)``, ``\quad``...);
# sentence punctuation at its end is dropped afterwards.
_WORD = re.compile(r"(?:\\[A-Za-z]+)?[^\s$\\]*")


def extract_boxed(text: str) -> str | None:
    r"""Content of the textually last ``\boxed`` / ``\fbox`` of ``text``, stripped.

    Two forms, the last one by position wins, whichever form it is:

    * braced ``\boxed{...}``: braces are matched by depth counting; a backslash escapes the
      next character (so ``\{`` and ``\}`` don't count). A box never closed (a truncated
      generation) gives None, never a truncated prefix of the answer.
    * brace-less ``\boxed 5`` / ``\boxed5`` / ``\fbox 5`` (legal TeX: a control word ends at
      the first non-letter, and an undelimited macro argument is the next token): the answer
      is the one *word* that follows (an optional leading control word such as ``\frac``,
      then everything up to the next whitespace, ``$`` or backslash -- ``\]``, ``\)``,
      ``\quad``), with trailing sentence punctuation (``.,;:``) removed (nothing left: None;
      a ``!`` stays, it is a factorial). So ``\boxed 4. Check: 2+3=5`` gives ``4`` and
      ``\boxed 5 apples`` gives ``5``: prose after the box is never part of the answer.
      TeX itself would box only the next token (``\boxed 42`` boxes the ``4``); the whole
      word is taken instead, because models write ``\boxed 42`` meaning 42 (the MATH
      benchmark's reference grader, Hendrycks et al. 2021, ``last_boxed_only_string`` in
      github.com/hendrycks/math, also reads past the first digit). ``\boxed\frac12`` gives
      ``\frac12`` (math-verify reads it as 1/2); ``\boxed x = 5`` gives ``x`` (use braces for
      an answer with spaces). A control word such as ``\boxedx`` is no box.

    Examples: ``extract_boxed(r"so \boxed{\frac{1}{2}}.")`` -> ``"\frac{1}{2}"``;
    ``extract_boxed(r"so the answer is $\boxed 5$.")`` -> ``"5"``;
    ``extract_boxed(r"\fbox{42}")`` -> ``"42"``; ``extract_boxed(r"\boxed{\frac{1}{2}")`` -> None.
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    n = len(text)
    if start >= n:
        return None
    if text[start] != "{":
        m = _WORD.match(text, start)
        arg = m.group(0).rstrip(".,;:") if m else ""
        return arg or None
    i = start = start + 1
    depth = 1
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None


class _DropTimeoutNotice(logging.Filter):
    """Hide math-verify's per-call notice that its SIGALRM timeout is off (worker threads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse(expr: str, timeout_s: int, wrap: bool = True) -> list[Any]:
    from math_verify import parse

    s = expr.strip()
    if wrap and "$" not in s and "\\boxed" not in s:
        s = f"${s}$"
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    return parse(s, parsing_timeout=timeout_s if _in_main_thread() else None)


def math_equal(gold: str, answer: str, float_rounding: int = 6, timeout_s: int = 5, wrap_answer: bool = True) -> bool:
    """True when the LaTeX/plain expressions ``answer`` and ``gold`` are mathematically
    equal per math-verify (``verify(parse(gold), parse(answer))``).

    Args:
        gold: the reference answer, e.g. ``"\\frac{1}{2}"`` or ``"0.5"``.
        answer: the extracted model answer.
        float_rounding: decimals kept when comparing floats (math-verify).
        timeout_s: parse / verify time limit in seconds (main thread only; math-verify
            enforces it with ``SIGALRM``).
        wrap_answer: treat ``answer`` as one math expression (wrapped in ``$...$``); False
            lets math-verify find the answer in free text.

    Raises:
        RewardFailed: ``parse`` when the gold answer cannot be parsed; ``timeout`` when
            math-verify times out; ``crash`` when it raises.
    """
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        g = _parse(gold, timeout_s)
        if not g:
            raise RewardFailed("parse", f"gold answer {gold!r} could not be parsed by math-verify")
        a = _parse(answer, timeout_s, wrap=wrap_answer)
        if not a:
            return False
        return bool(verify(g, a, float_rounding=float_rounding, raise_on_error=True,
                           timeout_seconds=timeout_s if _in_main_thread() else None))
    except RewardFailed:
        raise
    except TimeoutException as e:
        raise RewardFailed("timeout", f"math-verify took over {timeout_s}s: {e}") from e
    except Exception as e:
        raise RewardFailed("crash", f"math-verify raised {type(e).__name__}: {e}") from e


class MathAnswerOptions(RewardOptions):
    """Options of :func:`math_answer`.

    * ``answer_field`` -- task key of the gold answer (LaTeX or plain).
    * ``require_boxed`` -- True: a response without a complete ``\\boxed{}``/``\\fbox{}``
      scores 0; False: fall back to math-verify's own extraction on the whole response.
    * ``float_rounding``, ``timeout_s`` -- passed to math-verify.
    """

    answer_field: str = "answer"
    require_boxed: bool = True
    float_rounding: int = Field(6, ge=0)
    timeout_s: int = Field(5, ge=1)


@reward(MathAnswerOptions)
def math_answer(response: str, task: dict[str, Any], opts: MathAnswerOptions) -> float:
    """1.0 when the response's final answer equals ``task[answer_field]`` (math-verify),
    else 0.0. Only ``response`` (the completion) is read; the prompt never is.

    In a run it executes in a reward worker process (``molt_isolation = "process"``, see
    :mod:`molt_core.rewards`): ``timeout_s`` is math-verify's own ``SIGALRM`` limit there (the
    process's main thread), and the runtime kills the process at ``timeout_s + 1`` s
    (``molt_timeout``) whatever sympy is doing -- a C call holding the GIL included. Either way
    the trajectory fails ``timeout``.

    Raises:
        KeyError: the task has no ``answer_field``.
        RewardFailed: see :func:`math_equal`.
    """
    if opts.answer_field not in task:
        raise KeyError(f"math_answer needs task[{opts.answer_field!r}]; the task has {sorted(task)}")
    gold = str(task[opts.answer_field])
    box = extract_boxed(response)
    if box is None:
        if opts.require_boxed or not response.strip():
            return 0.0
        return 1.0 if math_equal(gold, response, opts.float_rounding, opts.timeout_s, wrap_answer=False) else 0.0
    if not box:
        return 0.0
    return 1.0 if math_equal(gold, box, opts.float_rounding, opts.timeout_s) else 0.0


# math-verify runs sympy on policy-written text: one call can sit in a C routine holding the GIL
# (``9^{9^{9^{9}}}``), where no thread deadline can fire; run it in a killable reward process.
math_answer.molt_isolation = "process"  # type: ignore[attr-defined]
math_answer.molt_timeout = lambda options: MathAnswerOptions.model_validate(options).timeout_s + 1.0  # type: ignore[attr-defined]
# optional module it imports (`molt plugins` names the extra, molt-sdk[envs], when it is missing)
math_answer.molt_requires = ("math_verify",)  # type: ignore[attr-defined]
