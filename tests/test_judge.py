"""LLM judge against a tiny fake OpenAI-compatible server on 127.0.0.1: score parsing and
normalisation, clear failures (no score, out of range, timeout), API key from the
environment, and the concurrency limit."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
from fastapi import FastAPI, Request

from molt_core.types import RewardFailed
from molt_plugins.judges.llm_judge import LLMJudge, llm_judge
from molt_core.server.app import serve_in_thread


class FakeJudgeServer:
    """Replies depend on the graded response found in the prompt: ``good`` -> "Score: 7",
    ``bold`` -> "**Score:** 9", ``noscore`` -> no number, ``big`` -> "Score: 12",
    ``slow`` -> sleeps 3 s, ``conc`` -> sleeps 1 s (to measure requests in flight)."""

    def __init__(self) -> None:
        self.auth: list[str] = []
        self.prompts: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(req: Request) -> dict:
            body = await req.json()
            self.auth.append(req.headers.get("authorization", ""))
            prompt = body["messages"][-1]["content"]
            self.prompts.append(prompt)
            resp = re.search(r"Response:\n(.*?)\n\n", prompt, re.DOTALL).group(1)
            if resp == "slow":
                await asyncio.sleep(3.0)
            if resp == "conc":  # count only these: a timed-out "slow" may still be sleeping here
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    await asyncio.sleep(1.0)
                finally:
                    self.in_flight -= 1
            text = {"good": "Mostly right.\nScore: 7", "bold": "Fine. **Score:** 9", "noscore": "I cannot grade this.",
                    "big": "Score: 12", "conc": "Score: 5", "slow": "Score: 1"}[resp]
            return {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.server, self.thread, base = serve_in_thread(app, "127.0.0.1", 0, "fake-judge")
        self.url = f"{base}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def server():
    s = FakeJudgeServer()
    yield s
    s.close()


@pytest.fixture()
def judge_env(monkeypatch):
    monkeypatch.setenv("MOLT_TEST_JUDGE_KEY", "sk-judge-123")


TASK = {"question": "What is 2 + 2?", "answer": "4"}


def test_score_is_parsed_and_normalised(server, judge_env):
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", model="judge-m")
    assert j.score("good", TASK) == pytest.approx(0.7, abs=1e-12)
    assert j.score("bold", TASK) == pytest.approx(0.9, abs=1e-12)
    assert server.auth[-1] == "Bearer sk-judge-123"
    p = server.prompts[-1]
    assert "What is 2 + 2?" in p and "Reference answer (may be empty):\n4" in p and "from 0 (wrong) to 10" in p
    j5 = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", min_score=1, max_score=9)
    assert j5.score("good", TASK) == pytest.approx((7 - 1) / 8, abs=1e-12)
    assert asyncio.run(j.ascore("good", TASK)) == pytest.approx(0.7, abs=1e-12)


def test_clear_failures(server, judge_env):
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", timeout_s=0.5)
    with pytest.raises(RewardFailed) as ei:
        j.score("noscore", TASK)
    assert ei.value.reason == "parse" and "I cannot grade this." in str(ei.value)
    with pytest.raises(RewardFailed, match=r"failed: parse .*12 is outside \[0, 10\]"):
        j.score("big", TASK)
    t0 = time.monotonic()
    with pytest.raises(RewardFailed) as ei:
        j.score("slow", TASK)
    assert ei.value.reason == "timeout" and time.monotonic() - t0 < 2.5
    dead = LLMJudge(base_url="http://127.0.0.1:9/v1", api_key_env="MOLT_TEST_JUDGE_KEY", timeout_s=2)
    with pytest.raises(RewardFailed) as ei:
        dead.score("good", TASK)
    assert ei.value.reason in ("judge_error", "timeout")


def test_configuration_errors(monkeypatch, server):
    monkeypatch.delenv("MOLT_JUDGE_BASE_URL", raising=False)
    monkeypatch.delenv("MOLT_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match="no loopback judge session"):
        LLMJudge()
    with pytest.raises(ValueError, match="MOLT_TEST_JUDGE_KEY .* is not set"):
        LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY")
    with pytest.raises(ValueError, match=r"judges.llm_judge.score_pattern: .*capturing group"):
        LLMJudge(base_url=server.url, score_pattern="Score")
    with pytest.raises(ValueError, match=r"max_score \(1.0\) must be > min_score \(5.0\)"):
        LLMJudge(base_url=server.url, min_score=5, max_score=1)
    monkeypatch.setenv("MOLT_TEST_JUDGE_KEY", "k")
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", rubric="{question} {nope} {response}")
    with pytest.raises(KeyError, match="nope"):
        j.prompt("x", TASK)


def test_loopback_session_from_the_runtime(monkeypatch, server):
    monkeypatch.setenv("MOLT_JUDGE_BASE_URL", server.url)
    monkeypatch.setenv("MOLT_JUDGE_API_KEY", "session-key")
    assert LLMJudge().score("good", TASK) == pytest.approx(0.7, abs=1e-12)
    assert server.auth[-1] == "Bearer session-key"


@pytest.mark.parametrize("limit", [2, 6])
def test_concurrency_limit(server, judge_env, limit):
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", max_concurrency=limit)
    server.max_in_flight = 0
    out: list[float] = []
    threads = [threading.Thread(target=lambda: out.append(j.score("conc", TASK))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [0.5] * 6
    if limit == 2:
        assert server.max_in_flight == 2
    else:
        assert server.max_in_flight > 2  # the limit above is what held it at 2


def test_as_a_reward(server, judge_env):
    opts = dict(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY")
    assert llm_judge("good", TASK, **opts) == pytest.approx(0.7, abs=1e-12)
    from molt_core.plugins import load_plugins

    h = load_plugins()
    assert h.get("judges", "llm_judge") is LLMJudge
    assert h.get("rewards", "llm_judge") is llm_judge


# -- issue 11 item 6: scores read whole, retries, structured output, group mode -------------
@pytest.mark.parametrize("reply,lo,hi,expected", [
    ("Score: 1e-1", 0, 1, 0.1),           # read whole: 0.1, never the 1 of "1e-1"
    ("Score: 1E+0", 0, 1, 1.0),
    ("**Score:** 0.7", 0, 1, 0.7),
    ("Score = 0.7", 0, 1, 0.7),
    ("Score: 0.70.", 0, 1, 0.7),          # a sentence's full stop is not part of the number
    ("score: **7**", 0, 10, 0.7),
    ("Score: 7/10", 0, 10, 0.7),          # N/D with D == max_score reads N
    ("Score: 7 out of 10", 0, 10, 0.7),
    ("Score: -2", -5, 5, 0.3),            # negative scores on a range that has them
    ("Score: 2\nOn reflection... Score: 9", 0, 10, 0.9),  # last match wins
])
def test_score_parsing_exact(reply, lo, hi, expected, judge_env, server):
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", min_score=lo, max_score=hi)
    assert j.parse(reply) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("reply,lo,hi,message", [
    ("Score: 1ex", 0, 1, r"failed: parse \(the judge's score '1ex' is not a number\)"),
    ("Score: 7.5.3", 0, 10, r"the judge's score '7.5.3' is not a number"),
    ("Score: 8,5", 0, 10, r"the judge's score '8,5' is not a number"),
    ("Score: 3/5", 0, 10, r"the judge's score '3/5' is out of 5, but the rubric's range is \[0, 10\]"),
    ("Score: -1", 0, 10, r"the judge's score -1 is outside \[0, 10\]"),     # refused, not clamped
    ("Score: 11", 0, 10, r"the judge's score 11 is outside \[0, 10\]"),
    ("Score: 2e1", 0, 10, r"the judge's score 20 is outside \[0, 10\]"),
    ("Score: nan", 0, 10, r"the judge's score 'nan' is not a number"),
    ("Scores are hard.", 0, 10, r"has no score matching"),
])
def test_score_parsing_refusals(reply, lo, hi, message, judge_env, server):
    j = LLMJudge(base_url=server.url, api_key_env="MOLT_TEST_JUDGE_KEY", min_score=lo, max_score=hi)
    with pytest.raises(RewardFailed, match=message) as ei:
        j.parse(reply)
    assert ei.value.reason == "parse"


class ScriptedJudge:
    """Replies from ``script`` in order: ``(status, content)``; 429/5xx carry
    ``retry-after-ms: 10``; content ``"SLEEP <s> <reply>"`` answers ``<reply>`` after ``<s>``
    seconds. Records each request's JSON body."""

    def __init__(self) -> None:
        self.script: list[tuple[int, str]] = []
        self.bodies: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(req: Request):
            from fastapi.responses import JSONResponse

            body = await req.json()
            self.bodies.append(body)
            status, text = self.script.pop(0) if self.script else (200, "Score: 5")
            if text.startswith("SLEEP "):  # "SLEEP <seconds> <reply>": answer late
                _, secs, text = text.split(" ", 2)
                await asyncio.sleep(float(secs))
            if status != 200:
                return JSONResponse({"error": {"message": text, "type": "x"}}, status_code=status,
                                    headers={"retry-after-ms": "10"})
            return {"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        self.server, self.thread, base = serve_in_thread(app, "127.0.0.1", 0, "scripted-judge")
        self.url = f"{base}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def scripted():
    s = ScriptedJudge()
    yield s
    s.close()


def test_transient_failures_are_retried(scripted, judge_env):
    j = LLMJudge(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", max_retries=3, backoff_s=0.01)
    scripted.bodies.clear()
    scripted.script = [(429, "slow down"), (503, "busy"), (500, "oops"), (200, "Score: 6")]
    assert j.score("x", TASK) == pytest.approx(0.6, abs=1e-12)
    assert len(scripted.bodies) == 4


def test_retries_exhausted_or_non_transient_fail(scripted, judge_env):
    j = LLMJudge(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", max_retries=2, backoff_s=0.01)
    scripted.bodies.clear()
    scripted.script = [(429, "a"), (429, "b"), (429, "c"), (200, "Score: 6")]
    with pytest.raises(RewardFailed, match=r"failed: judge_error \(the judge at .* failed 3 attempt\(s\) .*RateLimitError"):
        j.score("x", TASK)
    assert len(scripted.bodies) == 3
    scripted.bodies.clear()
    scripted.script = [(400, "bad request"), (200, "Score: 6")]
    with pytest.raises(RewardFailed, match=r"failed: judge_error \(BadRequestError"):
        j.score("x", TASK)
    assert len(scripted.bodies) == 1  # a 400 is not retried
    scripted.script = []


def test_request_timeout_default_leaves_room_for_retries(judge_env):
    o = dict(base_url="http://127.0.0.1:1/v1", api_key_env="MOLT_TEST_JUDGE_KEY")
    assert LLMJudge(**o).request_timeout_s == 20.0                       # 60 s / min(3, 3 + 1)
    assert LLMJudge(**o, timeout_s=9.0, max_retries=1).request_timeout_s == 4.5
    assert LLMJudge(**o, timeout_s=9.0, max_retries=0).request_timeout_s == 9.0  # one attempt: all of it
    assert LLMJudge(**o, timeout_s=9.0, request_timeout_s=2.0).request_timeout_s == 2.0


def test_a_request_that_times_out_is_retried_with_default_options(scripted, judge_env):
    # finding 10: with request_timeout_s unset the first attempt used to get all of timeout_s
    j = LLMJudge(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", timeout_s=3.0, backoff_s=0.01)
    scripted.bodies.clear()
    scripted.script = [(200, "SLEEP 5 Score: 1"), (200, "Score: 7")]
    t0 = time.monotonic()
    assert j.score("x", TASK) == pytest.approx(0.7, abs=1e-12)
    assert len(scripted.bodies) == 2 and 1.0 <= time.monotonic() - t0 < 2.5  # 1 s attempt, then the retry
    scripted.script = []


@pytest.mark.parametrize("pattern,reply,hi,expected", [
    (r"Score: (\d+)", "Score: 1e-1", 1, 0.1),      # finding 6: the capture '1' is read whole as 1e-1
    (r"Score: (\d+)", "Score: 0.9", 1, 0.9),       # not 0
    (r"Score: (\d+)", "Score: 7/10", 10, 0.7),     # the fraction the capture cut
    (r"Score: (\d+)", "Score: 7.", 10, 0.7),       # a full stop is no decimal
    (r"Score: (\d)", "Score: 10", 10, 1.0),        # a capture that cuts a longer integer
    (r"Rating=(\d+)", "Rating=2.5E-1 and more", 1, 0.25),
    (r"\[(\d+)\]", "[8]", 10, 0.8),
])
def test_custom_pattern_capture_is_read_as_the_whole_number(pattern, reply, hi, expected, judge_env):
    j = LLMJudge(base_url="http://127.0.0.1:1/v1", api_key_env="MOLT_TEST_JUDGE_KEY", score_pattern=pattern, max_score=hi)
    assert j.parse(reply) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pattern,reply,message", [
    (r"Score: (\d+)", "Score: 6-7", r"the judge's score '6-7' is not a number"),
    (r"Score: (\d+)", "Score: 7.5.3", r"the judge's score '7.5.3' is not a number"),
])
def test_custom_pattern_capture_inside_a_bad_number_is_refused(pattern, reply, message, judge_env):
    j = LLMJudge(base_url="http://127.0.0.1:1/v1", api_key_env="MOLT_TEST_JUDGE_KEY", score_pattern=pattern, max_score=10)
    with pytest.raises(RewardFailed, match=message):
        j.parse(reply)


def test_structured_output_sends_a_json_schema(scripted, judge_env):
    j = LLMJudge(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", structured=True)
    scripted.bodies.clear()
    scripted.script = [(200, '{"score": 8}'), (200, '```json\n{"score": 2.5}\n```'), (200, '{"score": 12}'),
                       (200, "Score: 8")]
    assert j.score("x", TASK) == pytest.approx(0.8, abs=1e-12)
    rf = scripted.bodies[0]["response_format"]
    assert rf["type"] == "json_schema" and rf["json_schema"]["schema"]["required"] == ["score"]
    assert j.score("x", TASK) == pytest.approx(0.25, abs=1e-12)
    with pytest.raises(RewardFailed, match=r"the judge's score 12 is outside \[0, 10\]"):
        j.score("x", TASK)
    with pytest.raises(RewardFailed, match=r"not a JSON object with 'score'"):
        j.score("x", TASK)


def test_group_mode_scores_every_response_in_one_call(scripted, judge_env, monkeypatch):
    from molt_plugins.judges import llm_judge as judge_mod

    monkeypatch.setattr(judge_mod, "_JUDGES", {})
    opts = dict(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", mode="group")
    scripted.bodies.clear()
    scripted.script = [(200, "B beats A.\nScore 1: 3\nScore 2: 9\nScore 3: **5**."),
                       (200, "Score 1: 3\nScore 3: 4"),
                       (200, '{"scores": [10, 0]}')]
    assert llm_judge(["a", "b", "c"], [TASK] * 3, **opts) == pytest.approx([0.3, 0.9, 0.5], abs=1e-12)
    p = scripted.bodies[0]["messages"][0]["content"]
    assert "Response 1:\na\n\nResponse 2:\nb\n\nResponse 3:\nc" in p and "comparing 3 responses" in p
    with pytest.raises(RewardFailed, match=r"no 'Score <i>: <number>' for response\(s\) \[2\]"):
        llm_judge(["a", "b", "c"], [TASK] * 3, **opts)
    assert llm_judge(["a", "b"], [TASK] * 2, **opts, structured=True) == [1.0, 0.0]
    assert scripted.bodies[-1]["response_format"]["json_schema"]["schema"]["required"] == ["scores"]


def test_judge_uses_the_runtime_session_of_the_call(server, monkeypatch):
    """Inside a reward call the runtime's per-call session wins over MOLT_JUDGE_*."""
    import contextvars

    from molt_core import rewards

    monkeypatch.setenv("MOLT_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    ctx = contextvars.copy_context()
    ctx.run(rewards._JUDGE.set, rewards.JudgeEndpoint(server.url, "per-call-key"))
    assert ctx.run(lambda: LLMJudge().score("good", TASK)) == pytest.approx(0.7, abs=1e-12)
    assert server.auth[-1] == "Bearer per-call-key"


def test_rank_scores_exact():
    from molt_plugins.judges.llm_judge import rank_scores

    assert rank_scores([2, 3, 1], 3) == [0.0, 1.0, 0.5]
    assert rank_scores([1, 2, 3, 4, 5], 5) == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert rank_scores([1], 1) == [1.0]
    for bad in ([2, 2, 1], [1, 2], [1, 2, 4]):
        with pytest.raises(RewardFailed, match=r"is not an order of the responses 1..3"):
            rank_scores(bad, 3)


def test_group_ranking_mode(scripted, judge_env, monkeypatch):
    from molt_plugins.judges import llm_judge as judge_mod

    monkeypatch.setattr(judge_mod, "_JUDGES", {})
    opts = dict(base_url=scripted.url, api_key_env="MOLT_TEST_JUDGE_KEY", mode="group", group_output="ranking")
    scripted.bodies.clear()
    scripted.script = [(200, "2 is best.\n**Ranking:** 2 > 3 > 1."), (200, "Ranking: 2, 2, 1"), (200, "Ranking: 2, best, 1"),
                       (200, '{"ranking": [1, 2]}')]
    assert llm_judge(["a", "b", "c"], [TASK] * 3, **opts) == [0.0, 1.0, 0.5]
    assert "ranking 3 responses" in scripted.bodies[0]["messages"][0]["content"]
    with pytest.raises(RewardFailed, match=r"ranking \[2, 2, 1\] is not an order"):
        llm_judge(["a", "b", "c"], [TASK] * 3, **opts)
    with pytest.raises(RewardFailed, match=r"ranking '2, best, 1' is not a list of response numbers"):
        llm_judge(["a", "b", "c"], [TASK] * 3, **opts)
    assert llm_judge(["a", "b"], [TASK] * 2, **opts, structured=True) == [1.0, 0.0]
    assert scripted.bodies[-1]["response_format"]["json_schema"]["schema"]["required"] == ["ranking"]
