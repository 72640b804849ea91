"""The one turn (molt_core/ledger/turn.py): prepare -> engine -> commit with its caps, hooks and
the guarantee that a turn that does not reach commit records nothing."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from molt_core.ledger import Ledger, take_turn
from molt_core.ledger import turn as turn_mod
from molt_core.runtime import workers
from molt_core.server import app as server_app
from molt_core.testing import ScriptedEngine, tiny_tokenizer
from molt_core.types import SamplingParams


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


MSGS = [{"role": "user", "content": "a"}]


def test_caps_and_stop_ids(tok):
    eng = ScriptedEngine(tok, ["One."])
    led = Ledger(tok)
    params = SamplingParams(max_tokens=50, stop_token_ids=[7])
    t = asyncio.run(take_turn(led, eng, MSGS, params, max_tokens=40, max_model_len=64, max_total_tokens=30))
    n = len(eng.prompts[0])
    assert t is not None and t.content == "One."
    assert eng.params[0].max_tokens == min(40, 64 - n, 30 - n)
    assert eng.params[0].stop_token_ids == sorted({7} | set(led.stop_token_ids))
    assert led.segments()[0].spans[0].temperature == params.temperature


def test_no_room_under_max_total_tokens_records_nothing(tok):
    eng = ScriptedEngine(tok, ["One."])
    led = Ledger(tok)
    n = len(led.prepare(MSGS).prompt_ids)
    assert asyncio.run(take_turn(led, eng, MSGS, max_total_tokens=n)) is None
    assert eng.calls == 0 and led.segments() == [] and sum(led.counts.values()) == 0


def test_hooks_run_in_order_and_a_refused_output_commits_nothing(tok):
    eng = ScriptedEngine(tok, ["One.", "Two."])
    led = Ledger(tok)
    seen: list[str] = []

    async def prepare_with(plan):
        seen.append("prepare")
        return plan()

    async def before(run):
        seen.append("before")
        return run.model_copy(update={"seed": 5})

    async def refuse(start):
        seen.append("call")
        await start()
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(take_turn(led, eng, MSGS, prepare_with=prepare_with, before_engine=before, call=refuse))
    assert seen == ["prepare", "before", "call"] and eng.params[0].seed == 5
    assert led.segments() == [] and sum(led.counts.values()) == 0
    t = asyncio.run(take_turn(led, eng, MSGS))
    assert t is not None and t.content == "Two." and led.counts["start"] == 1


def test_a_retry_answers_from_the_cached_turn(tok):
    eng = ScriptedEngine(tok, ["One."])
    led = Ledger(tok)
    t1 = asyncio.run(take_turn(led, eng, MSGS))
    t2 = asyncio.run(take_turn(led, eng, MSGS))
    assert t2 is t1 and eng.calls == 1 and led.counts["retry"] == 1


def test_every_caller_runs_the_one_turn():
    """The Env loop, the server and Ledger.generate share take_turn: none holds a copy of the turn."""
    assert workers.take_turn is turn_mod.take_turn and server_app.take_turn is turn_mod.take_turn
    for fn in (workers.RolloutWorker._env_turn, Ledger.generate, server_app.create_app):
        src = inspect.getsource(fn)
        assert "take_turn(" in src and ".commit(" not in src and "engine.generate(" not in src
