"""A resumed run samples what the uninterrupted run sampled (issue 24, item 5).

Before the fix a training rollout drew its sampling seed from the engine's own seed stream
(``random.Random(run.seed * 1000 + worker index)``), which restarts when ``--resume`` builds a
fresh engine: the first resumed step sampled other tokens, and the final weights differed. Now
rollout ``j`` of the task at stream index ``i`` samples with
``sample_seed("train", run.seed, i, j)`` (turn ``t`` with that + ``t``), independent of the
engine's history, the worker and the number of engines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import molt_core.runtime.loop as loop
from molt_core.config import RunConfig
from molt_core.cli.recipe import load_config
from molt_core.rollout.evalstats import eval_seed, sample_seed
from molt_core.plugins import load_plugins
from molt_core.runtime import RolloutWorker, main_job

# reward = reply length / 32: a random tiny model's replies differ in length, so every group has
# a spread of rewards and every step moves the weights (a step of equal rewards trains nothing)
LENGTH_ENV = textwrap.dedent('''
    from molt_core.agents import Env
    from molt_core.types import Result

    class Length(Env):
        def tasks(self, split, seed):
            for i in range(10**9):
                yield {"question": f"Say {i}."}

        def reset(self, task):
            return task["question"]

        def step(self, action_text, state):
            return Result(reward=len(action_text) / 32, terminated=True)
''')


ASSEMBLE = loop.assemble_batch  # the real one (each run below patches the module's name)


class _Crash(Exception):
    pass


def _run(tmp_path: Path, monkeypatch, name: str, engines: list[int], crash_at: int | None = None):
    """Run 4 steps in-process (checkpoint every 2) in ``tmp_path/name``; with ``crash_at`` the
    run dies as step ``crash_at`` assembles its batch and resumes with ``engines[1]`` engines.
    ``engine.max_batch_size = 1``: a row's logits then do not depend on which requests the
    engine's continuous batching happened to run beside it (they differ in the last float bits
    between two uninterrupted runs otherwise, and the correction reads the behaviour logprobs).
    Returns per trained step the groups' ``(token_ids, reward, logprobs)``, the final weights and
    the ``reward/mean`` of every metrics row."""
    agent = tmp_path / "length.py"
    agent.write_text(LENGTH_ENV)
    trained: list[list[list[tuple[list[int], float]]]] = []
    crash = {"at": crash_at}

    def record(groups, *a, **k):
        if crash["at"] is not None and len(trained) + 1 == crash["at"]:
            crash["at"] = None  # once: the resumed run goes on
            raise _Crash()
        trained.append([[(t.segments[0].token_ids, t.reward, t.segments[0].logprobs) for t in g.trajectories] for g in groups])
        return ASSEMBLE(groups, *a, **k)

    monkeypatch.setattr(loop, "assemble_batch", record)

    def cfg(num_engines: int) -> RunConfig:
        return RunConfig.model_validate({
            "run": {"steps": 4, "seed": 0, "threads": 1}, "agent": {"path": str(agent)},
            "engine": {"num_engines": num_engines, "max_batch_size": 1},
            "rollout": {"prompts_per_step": 3, "n_samples_per_prompt": 2, "max_tokens": 4, "temperature": 1.0},
            "trainer": {"lr": 3e-3}, "eval": {"n_problems": 0, "every": 0}, "sft": {"steps": 0},
            "checkpoint": {"every": 2, "keep": 3}})

    out = tmp_path / name
    if crash_at is None:
        main_job(cfg(engines[0]), load_plugins([]), out_dir=str(out), local=True)
    else:
        with pytest.raises(_Crash):
            main_job(cfg(engines[0]), load_plugins([]), out_dir=str(out), local=True)
        assert (out / "checkpoints" / "step_00000002").is_dir() and not (out / "checkpoints" / "step_00000004").exists()
        main_job(cfg(engines[1]), load_plugins([]), out_dir=str(out), local=True, resume=True)
    weights = load_file(str(out / "checkpoints" / "step_00000004" / "model" / "model.safetensors"))
    rewards = [r["reward/mean"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    return trained, weights, rewards


def test_killed_and_resumed_run_equals_the_uninterrupted_run_step_for_step(tmp_path, monkeypatch):
    """Uninterrupted 4 steps vs a run killed in step 3 (after the step-2 checkpoint) and
    resumed: the same token ids, behaviour logprobs and rewards in every step, the same
    ``reward/mean`` rows, bit-identical final weights. Before the fix step 3 sampled other tokens (the resumed engine's seed stream
    started over) and the weights differed."""
    a, wa, ra = _run(tmp_path, monkeypatch, "a", [1])
    b, wb, rb = _run(tmp_path, monkeypatch, "b", [1, 1], crash_at=3)
    assert len(a) == 4 and len(b) == 4  # the resumed run trained steps 3 and 4 only: 2 + 2
    assert len({r for step in a for g in step for _, r, _ in g}) > 1  # rewards spread: the weights moved
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert x == y, f"step {step}: the resumed run sampled other rollouts"
    assert ra == rb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_on_another_number_of_engines_samples_the_same_rollouts(tmp_path, monkeypatch):
    """Two engines until the crash, one after: every step's groups, in stream order, carry the
    same token ids, logprobs and rewards as an uninterrupted one-engine run, and the final
    weights are bit-identical (before the fix each engine drew from its own seed stream, and
    the batch came in the order groups were sharded over the engines)."""
    a, wa, ra = _run(tmp_path, monkeypatch, "a", [1])
    b, wb, rb = _run(tmp_path, monkeypatch, "b", [2, 1], crash_at=3)
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert x == y, f"step {step}: other rollouts on another number of engines"
    assert ra == rb
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("recipe", ["env_agent", "chat_agent"])
def test_training_rollout_seeds_do_not_depend_on_the_engine_history(recipe):
    """Another worker (another engine seed stream) that already served other rollouts samples
    the same tokens for the task at stream index 5 -- an Env episode through the ledger and a
    ChatAgent through the loopback server's OpenAI wire, both two turns. Without indices (the
    engine's own stream, the old behaviour) they differ."""
    cfg = load_config(recipe, ["rollout.max_tokens=6", "rollout.temperature=1.0"])
    w0, w1 = RolloutWorker(cfg, 0), RolloutWorker(cfg, 1)
    try:
        task = {"question": "What is 12 + 34?", "answer": "46"}
        tokens = lambda gs: [[s.token_ids for s in t.segments] for t in gs[0].trajectories]  # noqa: E731
        first = asyncio.run(w0.rollout([task], 3, indices=[5]))
        asyncio.run(w1.rollout([{"question": "What is 1 + 2?", "answer": "3"}], 2))  # advances w1's stream
        again = asyncio.run(w1.rollout([task], 3, indices=[5]))
        other = asyncio.run(w1.rollout([task], 3, indices=[6]))
        unseeded = asyncio.run(w1.rollout([task], 3))
        assert all(t.status == "ok" for t in first[0].trajectories + again[0].trajectories)
        assert tokens(again) == tokens(first)
        assert tokens(other) != tokens(first) and tokens(unseeded) != tokens(first)
        with pytest.raises(ValueError, match="indices has 2 entries for 1 tasks"):
            asyncio.run(w0.rollout([task], 2, indices=[1, 2]))
    finally:
        for w in (w0, w1):
            if w.server is not None:
                w.server.stop()
            w.engine.close()


def test_sample_seed_is_sha256_of_split_run_task_sample():
    want = int.from_bytes(hashlib.sha256(b"molt-train:7:3:1").digest()[:8], "big") >> 1
    assert sample_seed("train", 7, 3, 1) == want
    # eval seeds are unchanged (values of eval_seed at commit 264f099): molt eval still matches old runs
    assert eval_seed(0, 0, 0) == sample_seed("eval", 0, 0, 0) == 7106494274254481037
    assert eval_seed(7, 3, 1) == 8568772598159559641
    assert sample_seed("train", 0, 0, 0) != sample_seed("eval", 0, 0, 0)
    with pytest.raises(ValueError, match="split must be a non-empty name without ':'"):
        sample_seed("tr:ain", 0, 0, 0)
