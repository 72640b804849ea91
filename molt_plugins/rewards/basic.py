"""Text rewards: exact match and regex / format."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from molt_plugins.rewards.base import RewardOptions, reward

__all__ = ["exact_match", "regex", "ExactMatchOptions", "RegexOptions"]


class ExactMatchOptions(RewardOptions):
    """``strip`` -- compare whitespace-stripped texts; ``answer_field`` -- task key of the
    gold answer."""

    strip: bool = True
    answer_field: str = "answer"


@reward(ExactMatchOptions)
def exact_match(response: str, task: dict[str, Any], opts: ExactMatchOptions) -> float:
    """1.0 if ``response`` equals ``task[answer_field]`` (both stripped when ``strip``), else 0.0.

    Raises:
        KeyError: the task has no ``answer_field`` field.
    """
    if opts.answer_field not in task:
        raise KeyError(f"exact_match needs task[{opts.answer_field!r}]; the task has {sorted(task)}")
    a, b = str(response), str(task[opts.answer_field])
    if opts.strip:
        a, b = a.strip(), b.strip()
    return 1.0 if a == b else 0.0


_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "DOTALL": re.DOTALL}


class RegexOptions(RewardOptions):
    """Options of :func:`regex`.

    * ``pattern`` -- Python regular expression (validated at load).
    * ``mode`` -- ``search`` (anywhere), ``match`` (at the start) or ``fullmatch``.
    * ``flags`` -- any of ``IGNORECASE``, ``MULTILINE``, ``DOTALL``.
    * ``answer_group`` -- when set (group number or name), a match scores only if that
      group, stripped, equals ``task[answer_field]`` stripped: format and answer at once.
    * ``match_reward`` / ``no_match_reward`` -- the two values returned.
    """

    pattern: str
    mode: Literal["search", "match", "fullmatch"] = "search"
    flags: list[Literal["IGNORECASE", "MULTILINE", "DOTALL"]] = Field(default_factory=list)
    answer_group: int | str | None = None
    answer_field: str = "answer"
    match_reward: float = 1.0
    no_match_reward: float = 0.0

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _group_exists(self) -> "RegexOptions":
        g = self.answer_group
        if g is not None:
            p = re.compile(self.pattern)
            ok = (0 <= g <= p.groups) if isinstance(g, int) else g in p.groupindex
            if not ok:
                raise ValueError(f"answer_group {g!r} is not a group of pattern {self.pattern!r} "
                                 f"({p.groups} group(s), names {sorted(p.groupindex)})")
        return self


@reward(RegexOptions)
def regex(response: str, task: dict[str, Any], opts: RegexOptions) -> float:
    """``match_reward`` when ``pattern`` matches ``response`` (per ``mode``; and, with
    ``answer_group``, the group equals the gold answer), else ``no_match_reward``.

    Example: ``pattern = "^<think>.*</think>\\s*<answer>(.*)</answer>$"``, ``flags = ["DOTALL"]``
    checks the R1 format; ``answer_group = 1`` also checks the answer.

    Raises:
        KeyError: ``answer_group`` is set and the task has no ``answer_field``.
    """
    flags = 0
    for f in opts.flags:
        flags |= _FLAGS[f]
    m = getattr(re.compile(opts.pattern, flags), opts.mode)(response)
    if m is None:
        return opts.no_match_reward
    if opts.answer_group is not None:
        if opts.answer_field not in task:
            raise KeyError(f"regex with answer_group needs task[{opts.answer_field!r}]; the task has {sorted(task)}")
        got = m.group(opts.answer_group)
        if got is None or got.strip() != str(task[opts.answer_field]).strip():
            return opts.no_match_reward
    return opts.match_reward

regex.molt_example = {"options": {"pattern": r"answer is (\d+)"}}  # type: ignore[attr-defined]  # molt plugins --check

# ``re`` holds the GIL for a whole match: a backtracking pattern on policy-written text could
# stall the worker beyond any thread deadline; run it in a killable reward process.
regex.molt_isolation = "process"  # type: ignore[attr-defined]
