"""``llm_judge``: score a response against a rubric by asking an OpenAI-compatible endpoint.

The judge renders ``rubric`` with the task's fields and the response, calls
``chat.completions.create`` (stock OpenAI SDK), and parses the *last* match of
``score_pattern`` in the reply, normalised to [0, 1] with ``(s - min_score) / (max_score -
min_score)``. A reply without a score, or with one outside the range, raises
:class:`RewardFailed` (``parse``); a call over ``timeout_s`` raises ``timeout``; any other
API or connection error raises ``judge_error`` -- never a silent 0.0.

Endpoints: an external URL (``base_url``) with its key read from the environment variable
named by ``api_key_env`` (never written in a recipe); or, with ``base_url`` unset, the run's
own engine through the loopback server: the runtime opens a judge session that is never
trained on and exports ``MOLT_JUDGE_BASE_URL`` / ``MOLT_JUDGE_API_KEY`` for it.

At most ``max_concurrency`` requests of one judge are in flight at once (a semaphore shared
by every thread and event loop using it).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molt_core.types import RewardFailed
from molt_plugins.rewards.base import reward, validate_options

__all__ = ["LLMJudge", "LLMJudgeOptions", "llm_judge", "DEFAULT_RUBRIC"]

DEFAULT_RUBRIC = (
    "You are grading a response to a task.\n\n"
    "Task:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{response}\n\n"
    "Rate how well the response solves the task, from {min_score} (wrong) to {max_score} (perfect). "
    'Explain briefly, then end with a line "Score: <number>".'
)


class LLMJudgeOptions(BaseModel):
    """Options of the LLM judge (also the ``[rewards.llm_judge]`` table).

    * ``base_url`` -- OpenAI-compatible base URL (``.../v1``); None: the run's loopback server
      (``MOLT_JUDGE_BASE_URL`` / ``MOLT_JUDGE_API_KEY``, set by the runtime).
    * ``api_key_env`` -- environment variable holding the key for ``base_url``.
    * ``model`` -- model name sent to the endpoint.
    * ``rubric`` -- ``str.format`` template; fields: every task key, ``response``,
      ``min_score``, ``max_score`` (``question`` / ``answer`` default to "").
    * ``score_pattern`` -- regex with one group capturing the number (last match wins).
    * ``min_score`` / ``max_score`` -- the rubric's range, mapped to [0, 1].
    * ``max_concurrency`` -- requests in flight per judge; ``timeout_s`` -- per request.
    * ``temperature``, ``max_tokens`` -- judge sampling.
    """

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    model: str = "policy"
    rubric: str = DEFAULT_RUBRIC
    score_pattern: str = r"(?i)score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    min_score: float = 0.0
    max_score: float = 10.0
    max_concurrency: int = Field(4, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    temperature: float = Field(0.0, ge=0)
    max_tokens: int = Field(512, ge=1)

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            p = re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        if p.groups < 1:
            raise ValueError("needs a capturing group around the number, e.g. 'Score: (\\d+)'")
        return v

    @model_validator(mode="after")
    def _range(self) -> "LLMJudgeOptions":
        if not self.max_score > self.min_score:
            raise ValueError(f"max_score ({self.max_score}) must be > min_score ({self.min_score})")
        return self


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)


class LLMJudge:
    """An LLM-as-judge scorer (see the module docstring).

    Raises (at construction):
        ValueError: invalid options (naming ``judges.llm_judge.<field>``), no endpoint (no
            ``base_url`` and no loopback variables), or the API-key variable is unset.
    """

    Options = LLMJudgeOptions

    def __init__(self, **options: Any) -> None:
        self.options: LLMJudgeOptions = validate_options(LLMJudgeOptions, options, "judges.llm_judge")  # type: ignore[assignment]
        o = self.options
        if o.base_url is None:
            url, key = os.environ.get("MOLT_JUDGE_BASE_URL"), os.environ.get("MOLT_JUDGE_API_KEY")
            if not url:
                raise ValueError(
                    "llm_judge: base_url is unset and no loopback judge session is available "
                    "(MOLT_JUDGE_BASE_URL is not set by the runtime); set base_url to an OpenAI-compatible endpoint"
                )
            self.base_url, self.api_key = url, key or "molt-judge"
        else:
            key = os.environ.get(o.api_key_env)
            if not key:
                raise ValueError(
                    f"llm_judge: environment variable {o.api_key_env} (api_key_env) is not set; export the "
                    f"API key of {o.base_url} there"
                )
            self.base_url, self.api_key = o.base_url, key
        self._pattern = re.compile(o.score_pattern)
        self._slots = threading.BoundedSemaphore(o.max_concurrency)
        self._client: Any = None
        self._lock = threading.Lock()

    def _get_client(self) -> Any:
        with self._lock:
            if self._client is None:
                from openai import OpenAI

                self._client = OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0,
                                      timeout=self.options.timeout_s)
            return self._client

    def prompt(self, response: str, task: dict[str, Any]) -> str:
        """The rendered rubric.

        Raises:
            KeyError: the rubric names a field the task does not have.
        """
        o = self.options
        fields = _Fields({"question": "", "answer": "", **{k: v for k, v in task.items()}, "response": response,
                          "min_score": f"{o.min_score:g}", "max_score": f"{o.max_score:g}"})
        try:
            return o.rubric.format_map(fields)
        except KeyError as e:
            raise KeyError(f"llm_judge rubric refers to {e}, not a field of the task {sorted(task)}") from None

    def parse(self, text: str) -> float:
        """The normalised score in [0, 1] of the judge's reply ``text``.

        Raises:
            RewardFailed: ``parse`` when there is no score or it is outside the range.
        """
        o = self.options
        found = self._pattern.findall(text or "")
        if not found:
            raise RewardFailed("parse", f"the judge's reply has no score matching {o.score_pattern!r}: {(text or '')[:200]!r}")
        last = found[-1]
        s = float(last[0] if isinstance(last, tuple) else last)
        if not o.min_score <= s <= o.max_score:
            raise RewardFailed("parse", f"the judge's score {s:g} is outside [{o.min_score:g}, {o.max_score:g}]")
        return (s - o.min_score) / (o.max_score - o.min_score)

    def score(self, response: str, task: dict[str, Any]) -> float:
        """Ask the judge about ``response`` (the reply only) on ``task``; normalised score.

        Blocks while ``max_concurrency`` requests are in flight.

        Raises:
            RewardFailed: ``timeout``, ``judge_error`` (API / connection), ``parse``.
        """
        import openai

        o = self.options
        msgs = [{"role": "user", "content": self.prompt(response, task)}]
        client = self._get_client()
        with self._slots:
            try:
                r = client.chat.completions.create(model=o.model, messages=msgs, temperature=o.temperature,
                                                   max_tokens=o.max_tokens, timeout=o.timeout_s)
            except openai.APITimeoutError as e:
                raise RewardFailed("timeout", f"the judge at {self.base_url} did not answer in {o.timeout_s:g} s") from e
            except openai.OpenAIError as e:
                raise RewardFailed("judge_error", f"{type(e).__name__}: {e}") from e
        return self.parse(r.choices[0].message.content or "")

    async def ascore(self, response: str, task: dict[str, Any]) -> float:
        """:meth:`score` from async code (runs in a worker thread; same limits and errors)."""
        return await asyncio.to_thread(self.score, response, task)


_JUDGES: dict[str, LLMJudge] = {}
_JUDGES_LOCK = threading.Lock()


@reward(LLMJudgeOptions)
def llm_judge(response: str, task: dict[str, Any], opts: LLMJudgeOptions) -> float:
    """The LLM judge as a reward: one :class:`LLMJudge` per distinct options (shared, so
    ``max_concurrency`` holds across calls), ``judge.score(response, task)``.

    Raises:
        RewardFailed: see :meth:`LLMJudge.score`.
        ValueError: no endpoint / key (see :class:`LLMJudge`).
    """
    key = opts.model_dump_json()
    with _JUDGES_LOCK:
        judge = _JUDGES.get(key)
        if judge is None:
            judge = _JUDGES[key] = LLMJudge(**opts.model_dump())
    return judge.score(response, task)
