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
