"""A sync run launches a step's rollouts before the engines finished loading that step's
weights (``rollout(..., min_version=v)``): episodes prepare their prompts meanwhile, and no
token is sampled before the engine holds version ``v``; a failed load fails the waiting
rollouts instead of hanging them."""

import asyncio

from molt_core.agents import Env, EpisodeState
from molt_core.testing import ScriptedEngine, _worker, tiny_tokenizer
from molt_core.types import Result


class OneTurn(Env):
    def tasks(self, split, seed):
        yield {"question": "What is 1 + 1?", "answer": "2"}

    def reset(self, task):
        return task["question"]

    def step(self, action_text, state: EpisodeState):
        return Result(reward=1.0, terminated=True)


def _setup(fail=False):
    eng = ScriptedEngine(tiny_tokenizer())
    calls = []
    real = eng.generate

    async def generate(ids, params, images=None):
        calls.append(eng.version)
        return await real(ids, params, images)

    eng.generate = generate
    if fail:
        def boom(state, version):
            raise ValueError("refused: checksum mismatch")

        eng.load_weights = boom
    w = _worker(OneTurn(), eng, {}, None, {"max_turns": 1, "max_tokens": 8}, {})
    return eng, w, calls


def test_rollouts_sample_only_once_the_engine_holds_min_version():
    eng, w, calls = _setup()

    async def main():
        await w.load_weights({}, 0)  # the run's first publish
        task = asyncio.create_task(w.rollout([{"question": "What is 1 + 1?"}], 3, min_version=1))
        await asyncio.sleep(0.05)
        assert calls == [] and not task.done()  # prompts prepared, nothing sampled at version 0
        await w.load_weights({}, 1)
        return await asyncio.wait_for(task, 5)

    (group,) = asyncio.run(main())
    assert calls == [1, 1, 1]
    assert [t.status for t in group.trajectories] == ["ok"] * 3
    assert {v for t in group.trajectories for s in t.segments for v in s.versions if v is not None} == {1}
    # no min_version (or one already held): no wait
    eng2, w2, calls2 = _setup()

    async def held():
        await w2.load_weights({}, 4)
        return await asyncio.wait_for(w2.rollout([{"question": "q"}], 2, min_version=4), 5)

    asyncio.run(held())
    assert calls2 == [4, 4]


def test_a_failed_load_fails_the_waiting_rollouts_instead_of_hanging_them():
    eng, w, calls = _setup(fail=True)

    async def main():
        w._loaded(0)
        task = asyncio.create_task(w.rollout([{"question": "q"}], 2, min_version=1))
        await asyncio.sleep(0.05)
        try:
            await w.load_weights({}, 1)
        except ValueError as e:
            assert "checksum mismatch" in str(e)
        else:
            raise AssertionError("the load should have raised")
        return await asyncio.wait_for(task, 5)

    (group,) = asyncio.run(main())
    assert calls == []
    assert [t.status for t in group.trajectories] == ["failed"] * 2
    assert all("weight load failed" in t.error and "checksum mismatch" in t.error for t in group.trajectories)
