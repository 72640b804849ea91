"""``llm_judge``: score a response against a rubric by asking an OpenAI-compatible endpoint.

The judge renders ``rubric`` with the task's fields and the response, calls
``chat.completions.create`` (stock OpenAI SDK) and reads the score (see :meth:`LLMJudge.parse`
for the exact rules), normalised to [0, 1] with ``(s - min_score) / (max_score - min_score)``.

Failures are never a silent 0.0: each raises :class:`RewardFailed` and the runtime marks the
trajectory failed (excluded from training, counted in ``reward/llm_judge/failed``):

* ``parse`` -- no score in the reply, a malformed number (``Score: 7.5.3``, ``Score: 1ex``), a
  fraction whose denominator is not ``max_score``, or a score outside ``[min_score,
  max_score]`` (refused, not clamped: an out-of-range score means the judge misread the rubric);
* ``timeout`` -- no answer within ``timeout_s`` (all attempts and back-off included);
* ``judge_error`` -- a non-transient API error (400, 401, 404...), or transient ones (429, 408,
  409, 5xx, connection errors, per-request timeouts) still failing after ``max_retries`` retries
  with exponential back-off (``backoff_s * 2**k``, or the server's ``Retry-After``).

Structured output: ``structured = true`` sends a JSON schema (``response_format``) and reads
``{"score": <number>}`` (group mode: ``{"scores": [...]}``) instead of the text pattern; the
endpoint must support ``json_schema`` response formats (the run's own loopback server does not).

Group mode: ``mode = "group"`` makes the reward a group reward: one call shows the judge all
responses of a group side by side -- relative judging -- and reads either one score per
response (``group_output = "scores"``: ``Score 1: 7`` ...) or a best-first ranking
(``group_output = "ranking"``: ``Ranking: 2 > 3 > 1``, scored by :func:`rank_scores`).

Endpoints: an external URL (``base_url``) with its key read from the environment variable
named by ``api_key_env`` (never written in a recipe); or, with ``base_url`` unset, the run's
own engine through the loopback server: the runtime opens a fresh judge session for each
judge call (:func:`molt_core.rewards.judge_endpoint`), closed when the score is read and never
trained on. Outside a run, ``MOLT_JUDGE_BASE_URL`` / ``MOLT_JUDGE_API_KEY`` name the endpoint.

At most ``max_concurrency`` requests of one judge are in flight at once (a semaphore shared
by every thread using it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molt_core.rewards import judge_endpoint
from molt_core.types import RewardFailed
from molt_plugins.rewards.base import validate_options

__all__ = ["LLMJudge", "LLMJudgeOptions", "whole_token", "llm_judge", "DEFAULT_RUBRIC", "DEFAULT_GROUP_RUBRIC", "DEFAULT_RANKING_RUBRIC",
           "parse_number", "rank_scores"]

DEFAULT_RUBRIC = (
    "You are grading a response to a task.\n\n"
    "Task:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{response}\n\n"
    "Rate how well the response solves the task, from {min_score} (wrong) to {max_score} (perfect). "
    'Explain briefly, then end with a line "Score: <number>".'
)

DEFAULT_GROUP_RUBRIC = (
    "You are comparing {n} responses to the same task.\n\n"
    "Task:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "{responses}\n\n"
    "Compare the responses with each other and rate each from {min_score} (worst) to {max_score} (best). "
    'Explain briefly, then end with one line per response: "Score 1: <number>", "Score 2: <number>", ...'
)

DEFAULT_RANKING_RUBRIC = (
    "You are ranking {n} responses to the same task.\n\n"
    "Task:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "{responses}\n\n"
    "Compare the responses with each other and rank them from best to worst. "
    'Explain briefly, then end with one line "Ranking: <response numbers, best first>", e.g. "Ranking: 2 > 3 > 1".'
)

_NUMBER = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)(?:/((?:\d+(?:\.\d*)?|\.\d+)))?")


_NUM_TOKEN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:/(?:\d+(?:\.\d*)?|\.\d+))?")


def whole_token(text: str, span: tuple[int, int]) -> str:
    r"""The text of ``span`` (a pattern's capture) widened to every number token it overlaps.

    A custom ``score_pattern`` such as ``Score: (\d+)`` captures only ``1`` of ``Score: 1e-1``
    and ``0`` of ``Score: 0.9``; read alone, those would be 1 and 0. The capture is therefore
    extended to the start and end of each number token (sign, decimals, exponent, ``/D``) it
    overlaps or touches: ``1e-1`` and ``0.9`` are read whole, and ``Score: 6-7`` (two
    touching tokens) becomes ``6-7``, which :func:`parse_number` refuses. A capture that cuts
    no number is returned as is.
    """
    a, b = span
    for m in _NUM_TOKEN.finditer(text, text.rfind("\n", 0, a) + 1):
        if m.start() > b:
            break
        if m.end() >= a and m.end() > m.start():  # overlaps or touches the capture
            a, b = min(a, m.start()), max(b, m.end())
    return text[a:b]


def parse_number(token: str, min_score: float, max_score: float) -> float:
    """The raw score in ``token`` (the text captured after the ``Score:`` label), read whole.

    Rules: surrounding ``*`` and one trailing sentence mark (``.,;:!)``) are stripped; the rest
    must be one number (sign, decimals and exponent allowed: ``-2``, ``0.70``, ``1e-1``) or a
    fraction ``N/D`` with ``D == max_score`` (read as ``N``); it must lie in ``[min_score,
    max_score]``.

    Raises:
        RewardFailed: ``parse``, naming the token and the rule it breaks.
    """
    tok = token.strip().strip("*").rstrip(".,;:!)").strip("*")
    m = _NUMBER.fullmatch(tok)
    if not m:
        raise RewardFailed("parse", f"the judge's score {token!r} is not a number")
    s = float(m.group(1))
    if m.group(2) is not None:
        d = float(m.group(2))
        if d != max_score:
            raise RewardFailed("parse", f"the judge's score {token!r} is out of {d:g}, but the rubric's range is "
                                        f"[{min_score:g}, {max_score:g}]")
    if not min_score <= s <= max_score:
        raise RewardFailed("parse", f"the judge's score {s:g} is outside [{min_score:g}, {max_score:g}]")
    return s


class LLMJudgeOptions(BaseModel):
    """Options of the LLM judge (also the ``[rewards.llm_judge]`` table).

    * ``base_url`` -- OpenAI-compatible base URL (``.../v1``); None: the run's loopback server
      (``MOLT_JUDGE_BASE_URL`` / ``MOLT_JUDGE_API_KEY``, set by the runtime).
    * ``api_key_env`` -- environment variable holding the key for ``base_url``.
    * ``model`` -- model name sent to the endpoint.
    * ``rubric`` -- ``str.format`` template; fields: every task key, ``response``,
      ``min_score``, ``max_score`` (``question`` / ``answer`` default to "").
    * ``score_pattern`` -- regex whose first group captures the score token (last match wins;
      the token is read whole by :func:`parse_number`).
    * ``min_score`` / ``max_score`` -- the rubric's range, mapped to [0, 1].
    * ``max_concurrency`` -- requests in flight per judge.
    * ``timeout_s`` -- deadline of one score, retries included (in a recipe the runtime bounds
      the reward call at ``timeout_s + 2``); ``request_timeout_s`` -- per attempt (None:
      ``timeout_s / min(3, max_retries + 1)``, so that a request that times out is retried
      within the deadline; see :attr:`LLMJudge.request_timeout_s`).
    * ``max_retries`` / ``backoff_s`` -- retries of transient failures (429, 408, 409, 5xx,
      connection errors, request timeouts), waiting ``backoff_s * 2**k`` or ``Retry-After``.
    * ``structured`` -- ask for ``{"score": <number>}`` through a JSON-schema
      ``response_format`` instead of reading ``score_pattern``.
    * ``mode`` -- ``single`` (one call per response) or ``group`` (one call per group, every
      response side by side, ``group_rubric``; fields: task keys, ``responses``, ``n``,
      ``min_score``, ``max_score``).
    * ``group_output`` -- group mode: ``scores`` (a score per response) or ``ranking`` (the
      responses ranked best first; the response ranked ``p`` of ``n`` scores
      ``(n - 1 - p) / (n - 1)``, see :func:`rank_scores`). ``group_rubric`` None picks
      ``DEFAULT_GROUP_RUBRIC`` or ``DEFAULT_RANKING_RUBRIC``.
    * ``temperature``, ``max_tokens`` -- judge sampling.
    """

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    model: str = "policy"
    rubric: str = DEFAULT_RUBRIC
    score_pattern: str = r"(?i)\bscore\b\s*\**\s*[:=]\s*\**\s*(\S+)"
    min_score: float = 0.0
    max_score: float = 10.0
    max_concurrency: int = Field(4, ge=1)
    timeout_s: float = Field(60.0, gt=0)
    request_timeout_s: float | None = Field(None, gt=0)
    max_retries: int = Field(3, ge=0)
    backoff_s: float = Field(0.5, ge=0)
    structured: bool = False
    mode: Literal["single", "group"] = "single"
    group_output: Literal["scores", "ranking"] = "scores"
    group_rubric: str | None = None
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


_GROUP_PATTERN = re.compile(r"(?i)\bscore\s*#?\s*(\d+)\s*\**\s*[:=]\s*\**\s*(\S+)")


_RANKING_PATTERN = re.compile(r"(?i)\branking\b\s*\**\s*[:=]\s*\**\s*([^\n]*)")


def rank_scores(ranking: list[int], n: int) -> list[float]:
    """Scores of responses ``1..n`` from a best-first ``ranking`` of their numbers: the
    response at position ``p`` (0 = best) scores ``(n - 1 - p) / (n - 1)`` (1.0 when n = 1).

    Raises:
        RewardFailed: ``parse`` -- the ranking is not a permutation of 1..n.
    """
    if sorted(ranking) != list(range(1, n + 1)):
        raise RewardFailed("parse", f"the judge's ranking {ranking} is not an order of the responses 1..{n}")
    out = [0.0] * n
    for p, r in enumerate(ranking):
        out[r - 1] = 1.0 if n == 1 else (n - 1 - p) / (n - 1)
    return out


def _schema(key: str) -> dict[str, Any]:
    typ = {"score": {"type": "number"}, "scores": {"type": "array", "items": {"type": "number"}},
           "ranking": {"type": "array", "items": {"type": "integer"}}}[key]
    return {"type": "json_schema", "json_schema": {"name": f"judge_{key}", "strict": True,
            "schema": {"type": "object", "properties": {key: typ}, "required": [key], "additionalProperties": False}}}


def _transient(e: Exception) -> bool:
    import openai

    if isinstance(e, openai.APIStatusError):
        return e.status_code in (408, 409, 429) or e.status_code >= 500
    return isinstance(e, openai.APIConnectionError)  # includes APITimeoutError


def _retry_after(e: Exception) -> float | None:
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            v = float(headers.get(name))
        except (TypeError, ValueError):
            continue
        if v >= 0:
            return v * scale
    return None


class LLMJudge:
    """An LLM-as-judge scorer (see the module docstring).

    Raises (at construction):
        ValueError: invalid options (naming ``judges.llm_judge.<field>``), no endpoint (no
            ``base_url``, no loopback session and no ``MOLT_JUDGE_BASE_URL``), or the API-key
            variable is unset.
    """

    Options = LLMJudgeOptions

    def __init__(self, **options: Any) -> None:
        self.options: LLMJudgeOptions = validate_options(LLMJudgeOptions, options, "judges.llm_judge")  # type: ignore[assignment]
        o = self.options
        if o.base_url is None:
            if judge_endpoint() is None and not os.environ.get("MOLT_JUDGE_BASE_URL"):
                raise ValueError(
                    "llm_judge: base_url is unset and no loopback judge session is available "
                    "(MOLT_JUDGE_BASE_URL is not set by the runtime); set base_url to an OpenAI-compatible endpoint"
                )
            self.base_url: str | None = None
            self.api_key: str | None = None
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

    def _endpoint(self) -> tuple[str, str, bool]:
        """``(base_url, api_key, shared)``: the fixed endpoint (shared client), else the
        runtime's session for this call, else the ``MOLT_JUDGE_*`` variables."""
        if self.base_url is not None:
            return self.base_url, self.api_key or "", True
        ep = judge_endpoint()
        if ep is not None:
            return ep.base_url, ep.api_key, False
        url = os.environ.get("MOLT_JUDGE_BASE_URL")
        if not url:
            raise RewardFailed("judge_error", "no judge endpoint: base_url is unset and no loopback judge session is open")
        return url, os.environ.get("MOLT_JUDGE_API_KEY") or "molt-judge", False

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
        return self._render(o.rubric, task, {"response": response})

    def group_prompt(self, responses: list[str], task: dict[str, Any]) -> str:
        """The rendered ``group_rubric`` for the responses of one group (numbered from 1).

        Raises:
            KeyError: the rubric names a field the task does not have.
        """
        o = self.options
        template = o.group_rubric or (DEFAULT_RANKING_RUBRIC if o.group_output == "ranking" else DEFAULT_GROUP_RUBRIC)
        listed = "\n\n".join(f"Response {i}:\n{r}" for i, r in enumerate(responses, 1))
        return self._render(template, task, {"responses": listed, "n": str(len(responses))})

    def _render(self, template: str, task: dict[str, Any], extra: dict[str, str]) -> str:
        o = self.options
        fields = _Fields({"question": "", "answer": "", **{k: v for k, v in task.items()}, **extra,
                          "min_score": f"{o.min_score:g}", "max_score": f"{o.max_score:g}"})
        try:
            return template.format_map(fields)
        except KeyError as e:
            raise KeyError(f"llm_judge rubric refers to {e}, not a field of the task {sorted(task)}") from None

    def _normalise(self, s: float) -> float:
        o = self.options
        return (s - o.min_score) / (o.max_score - o.min_score)

    @property
    def request_timeout_s(self) -> float:
        """Seconds one attempt may take: ``request_timeout_s`` when set, else ``timeout_s /
        min(3, max_retries + 1)`` (60 s, 3 retries: 20 s), so that a timed-out request leaves
        time for a retry within the deadline (with ``max_retries = 0`` the one attempt gets
        all of ``timeout_s``)."""
        o = self.options
        return o.request_timeout_s if o.request_timeout_s is not None else o.timeout_s / min(3, o.max_retries + 1)

    def parse(self, text: str) -> float:
        r"""The normalised score in [0, 1] of the judge's reply ``text``: the last match of
        ``score_pattern``, its token read whole by :func:`parse_number` (``Score: 1e-1`` is
        0.1, never 1; ``**Score:** 7``, ``Score = 7``, ``Score: 7/10``, ``Score: 7.`` read 7).
        The capture is widened to the whole number token it cuts (:func:`whole_token`), so a
        custom pattern such as ``Score: (\d+)`` also reads ``Score: 1e-1`` as 0.1 and
        ``Score: 0.9`` as 0.9, and ``Score: 6-7`` is refused.

        Raises:
            RewardFailed: ``parse`` when there is no score, it is malformed or outside the range.
        """
        o = self.options
        text = text or ""
        found = list(self._pattern.finditer(text))
        if not found:
            raise RewardFailed("parse", f"the judge's reply has no score matching {o.score_pattern!r}: {text[:200]!r}")
        return self._normalise(parse_number(whole_token(text, found[-1].span(1)), o.min_score, o.max_score))

    def parse_json(self, text: str, n: int | None = None) -> float | list[float]:
        """Structured output: ``{"score": x}`` (or, with ``n``, ``{"scores": [n numbers]}``),
        each checked against the range and normalised.

        Raises:
            RewardFailed: ``parse`` -- not that JSON object, wrong count, or out of range.
        """
        o = self.options
        body = (text or "").strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        key = "score" if n is None else "scores"
        try:
            data = json.loads(body)
            val = data[key]
        except (ValueError, TypeError, KeyError) as e:
            raise RewardFailed("parse", f"the judge's reply is not a JSON object with {key!r} ({e}): {body[:200]!r}") from None
        vals = [val] if n is None else val
        if not isinstance(vals, list) or (n is not None and len(vals) != n):
            raise RewardFailed("parse", f"the judge returned {vals!r:.100} for {n} responses; expected {n} scores")
        out = []
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RewardFailed("parse", f"the judge's score {v!r} is not a number")
            out.append(self._normalise(parse_number(repr(float(v)), o.min_score, o.max_score)))
        return out[0] if n is None else out

    def parse_group(self, text: str, n: int) -> list[float]:
        """Group mode, text: the last ``Score <i>: <number>`` line for each ``i`` in 1..n.

        Raises:
            RewardFailed: ``parse`` -- a response without a score, or a bad score.
        """
        o = self.options
        last: dict[int, str] = {}
        for i, tok in _GROUP_PATTERN.findall(text or ""):
            last[int(i)] = tok
        missing = [i for i in range(1, n + 1) if i not in last]
        if missing:
            raise RewardFailed("parse", f"the judge's reply has no 'Score <i>: <number>' for response(s) {missing}: "
                                        f"{(text or '')[:200]!r}")
        return [self._normalise(parse_number(last[i], o.min_score, o.max_score)) for i in range(1, n + 1)]

    def parse_ranking(self, text: str, n: int) -> list[float]:
        """Group ranking mode: the last ``Ranking: 2 > 3 > 1`` line (numbers separated by
        ``>``, commas or spaces), scored by :func:`rank_scores`; structured mode reads
        ``{"ranking": [2, 3, 1]}``.

        Raises:
            RewardFailed: ``parse`` -- no ranking line, a non-integer entry, or not an order of 1..n.
        """
        if self.options.structured:
            body = (text or "").strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
            try:
                items = json.loads(body)["ranking"]
            except (ValueError, TypeError, KeyError) as e:
                raise RewardFailed("parse", f"the judge's reply is not a JSON object with 'ranking' ({e}): {body[:200]!r}") from None
            if not isinstance(items, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
                raise RewardFailed("parse", f"the judge's ranking {items!r:.100} is not a list of response numbers")
            return rank_scores(items, n)
        found = _RANKING_PATTERN.findall(text or "")
        if not found:
            raise RewardFailed("parse", f"the judge's reply has no 'Ranking: ...' line: {(text or '')[:200]!r}")
        parts = [p for p in re.split(r"[>,\s]+", found[-1].strip().rstrip(".").replace("*", "")) if p]
        if not all(p.isdigit() for p in parts):
            raise RewardFailed("parse", f"the judge's ranking {found[-1].strip()!r} is not a list of response numbers")
        return rank_scores([int(p) for p in parts], n)

    def complete(self, prompt: str, schema: str | None = None) -> str:
        """One judge request with retries (see the module docstring); the reply text.

        Blocks while ``max_concurrency`` requests are in flight.

        Raises:
            RewardFailed: ``timeout`` (``timeout_s`` spent), ``judge_error`` (non-transient
                error, or transient ones after ``max_retries`` retries).
        """
        import openai

        o = self.options
        deadline = time.monotonic() + o.timeout_s
        url, key, shared = self._endpoint()
        extra = {"response_format": _schema(schema or "score")} if o.structured else {}
        msgs = [{"role": "user", "content": prompt}]
        client = self._get_client() if shared else openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=o.timeout_s)
        try:
            with self._slots:
                attempt = 0
                while True:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RewardFailed("timeout", f"the judge at {url} did not answer in {o.timeout_s:g} s "
                                                      f"({attempt} attempt(s))")
                    try:
                        r = client.chat.completions.create(model=o.model, messages=msgs, temperature=o.temperature,
                                                           max_tokens=o.max_tokens,
                                                           timeout=min(self.request_timeout_s, remaining), **extra)
                        return r.choices[0].message.content or ""
                    except openai.OpenAIError as e:
                        attempt += 1
                        if not _transient(e):
                            raise RewardFailed("judge_error", f"{type(e).__name__}: {e}") from e
                        wait = _retry_after(e)
                        wait = o.backoff_s * 2 ** (attempt - 1) if wait is None else wait
                        if attempt > o.max_retries or time.monotonic() + wait >= deadline:
                            reason = "timeout" if isinstance(e, openai.APITimeoutError) or attempt <= o.max_retries else "judge_error"
                            raise RewardFailed(reason, f"the judge at {url} failed {attempt} attempt(s) within "
                                                       f"{o.timeout_s:g} s; last: {type(e).__name__}: {e}") from e
                        time.sleep(wait)
        finally:
            if not shared:
                client.close()

    def score(self, response: str, task: dict[str, Any]) -> float:
        """Ask the judge about ``response`` (the reply only) on ``task``; normalised score.

        Raises:
            RewardFailed: ``timeout``, ``judge_error`` (API / connection), ``parse``.
        """
        text = self.complete(self.prompt(response, task))
        return self.parse_json(text) if self.options.structured else self.parse(text)  # type: ignore[return-value]

    def score_group(self, responses: list[str], tasks: list[dict[str, Any]]) -> list[float]:
        """Group mode: one request showing every response (all of one task); one normalised
        score per response, in order.

        Raises:
            RewardFailed: as :meth:`score`; ValueError: the responses are of different tasks.
        """
        if not responses:
            return []
        if any(t != tasks[0] for t in tasks):
            raise ValueError("llm_judge group mode compares responses to one task; got several tasks")
        o = self.options
        text = self.complete(self.group_prompt(responses, tasks[0]), schema="ranking" if o.group_output == "ranking" else "scores")
        if o.group_output == "ranking":
            return self.parse_ranking(text, len(responses))
        if o.structured:
            return self.parse_json(text, n=len(responses))  # type: ignore[return-value]
        return self.parse_group(text, len(responses))

    async def ascore(self, response: str, task: dict[str, Any]) -> float:
        """:meth:`score` from async code (runs in a worker thread; same limits and errors)."""
        return await asyncio.to_thread(self.score, response, task)


_JUDGES: dict[str, LLMJudge] = {}
_JUDGES_LOCK = threading.Lock()


def _judge_for(opts: LLMJudgeOptions) -> LLMJudge:
    key = opts.model_dump_json()
    with _JUDGES_LOCK:
        judge = _JUDGES.get(key)
        if judge is None:
            judge = _JUDGES[key] = LLMJudge(**opts.model_dump())
    return judge


def llm_judge(response: Any, task: Any, **options: Any) -> Any:
    """The LLM judge as a reward: one :class:`LLMJudge` per distinct options (shared, so
    ``max_concurrency`` holds across calls). ``mode = "single"``: ``llm_judge(response, task,
    **options) -> float``; ``mode = "group"`` (a group reward, ``molt_group``):
    ``llm_judge(responses, tasks, **options) -> list[float]``.

    Raises:
        RewardFailed: see :meth:`LLMJudge.score`.
        ValueError: invalid options (naming ``rewards.llm_judge.<field>``), no endpoint / key.
    """
    opts: LLMJudgeOptions = validate_options(LLMJudgeOptions, options, "rewards.llm_judge")  # type: ignore[assignment]
    judge = _judge_for(opts)
    if opts.mode == "group":
        return judge.score_group(list(response), list(task))
    return judge.score(response, task)


llm_judge.Options = LLMJudgeOptions  # type: ignore[attr-defined]
llm_judge.molt_group = lambda options: options.get("mode") == "group"  # type: ignore[attr-defined]
llm_judge.molt_judge_session = lambda options: not options.get("base_url")  # type: ignore[attr-defined]
#: Extra seconds the runtime allows beyond the judge's own ``timeout_s`` (its deadline, retries
#: included): the judge's own verdict -- a score, or ``failed: timeout`` -- comes first; the
#: runtime's bound is a backstop (an HTTP read timeout is per read, not per response).
JUDGE_TIMEOUT_MARGIN_S = 2.0
llm_judge.molt_timeout = lambda options: float(options.get("timeout_s", 60.0)) + JUDGE_TIMEOUT_MARGIN_S  # type: ignore[attr-defined]
