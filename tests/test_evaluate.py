"""`molt eval` (issue 13 item 12): the run's eval code path on a checkpoint gives the run's own
numbers; per-sample seeds make eval independent of engine history and sharding; pass@k
arithmetic; checkpoints verified; an OpenAI-compatible URL evaluates text-only."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from molt_core.config import RunConfig
from molt_core.rollout.evalstats import eval_metrics, eval_seed, pass_at_k
from molt_core.cli.evaluate import evaluate, resolve_model
from molt_core.plugins import load_plugins
from molt_core.runtime.workers import RolloutWorker, _sampling
from molt_core.train.checkpoint import CheckpointCorrupt

MOLT = [sys.executable, "-m", "molt_core.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}

# Two turns; a turn is right when its reply has an even number of characters, so a random tiny
# model solves a task about half the time (pass@1 strictly between 0 and 1).
AGENT = '''
from molt_core.agents import Env
from molt_core.types import Result


class Parity(Env):
    def tasks(self, split, seed):
        for i in range(10**6 if split == "train" else 16):
            yield {"i": i}

    def reset(self, task):
        return f"Say {task['i']}."

    def step(self, action, state):
        ok = len(action) % 2 == 0
        if state.turn == 0:
            return Result(reward=0.5 * ok, observation="Again.")
        return Result(reward=0.5 * ok, terminated=True, score=1.0 if ok else 0.0)
'''

RECIPE = '''
[run]
seed = 3
steps = 2
[agent]
path = "{agent}"
[rollout]
prompts_per_step = 2
n_samples_per_prompt = 2
max_tokens = 6
max_turns = 2
[eval]
n_problems = 8
k = 2
[sft]
steps = 0
[checkpoint]
every = 1
keep = 3
'''


def _recipe(tmp_path: Path) -> Path:
    (tmp_path / "parity.py").write_text(AGENT)
    r = tmp_path / "parity.toml"
    r.write_text(RECIPE.format(agent=tmp_path / "parity.py"))
    return r


def _cfg(tmp_path: Path) -> RunConfig:
    from molt_core.cli.recipe import load_config

    return load_config(str(_recipe(tmp_path)), ())


# -- arithmetic ----------------------------------------------------------------------------------

def test_eval_seed_is_sha256_of_run_task_sample():
    want = int.from_bytes(hashlib.sha256(b"molt-eval:3:5:1").digest()[:8], "big") >> 1
    assert eval_seed(3, 5, 1) == want
    seeds = {eval_seed(0, i, j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 1 << 63 for s in seeds)


def test_eval_metrics_by_hand():
    rs = [{"index": 1, "n": 4, "correct": 0, "rewards": [0.0, 0.0, 0.5], "failed": 1},
          {"index": 0, "n": 4, "correct": 2, "rewards": [1.0, 1.0, 0.0, 0.5], "failed": 0}]
    m = eval_metrics(rs, 2)
    # pass@1 = mean(2/4, 0/4); pass@2 = mean(1 - C(2,2)/C(4,2), 1 - C(4,2)/C(4,2)) = mean(5/6, 0)
    assert m == {"eval/pass@1": 0.25, "eval/pass@2": (1 - 1 / 6) / 2, "eval/reward": 3.0 / 7, "eval/failed": 1.0,
                 "eval/rollouts": 8.0}
    assert eval_metrics(list(reversed(rs)), 2) == m  # index order, whatever order results arrive in
    assert pass_at_k(4, 2, 2) == 1 - 1 / 6
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
        eval_metrics(rs, 5)


# -- the worker's eval path ----------------------------------------------------------------------

def test_eval_is_independent_of_engine_history_and_sharding(tmp_path):
    """Sample j of task i is seeded by eval_seed(run.seed, i, j): the same results after the
    engine served training rollouts, and with the tasks split over two shards (two engines)."""
    w = RolloutWorker(_cfg(tmp_path))
    try:
        tasks = [{"i": i} for i in range(6)]
        first = asyncio.run(w.evaluate_tasks(tasks, 2, 1.0))
        asyncio.run(w.rollout([{"i": 100}, {"i": 101}], 3))  # advances the engine's own seed stream
        again = asyncio.run(w.evaluate_tasks(tasks, 2, 1.0))
        shards = asyncio.run(w.evaluate_tasks(tasks[1::2], 2, 1.0, [1, 3, 5])) + \
            asyncio.run(w.evaluate_tasks(tasks[0::2], 2, 1.0, [0, 2, 4]))
        # the fault this guards against: unseeded sampling (the engine's own stream) draws other samples
        params = _sampling(w.cfg, w._stop_ids, temperature=1.0)
        unseeded = [asyncio.run(w._group(t, "g", params, 2)) for t in tasks]
    finally:
        w.engine.close()
    key = lambda rs: sorted((r["index"], r["correct"], r["rewards"]) for r in rs)  # noqa: E731
    assert key(again) == key(first) and key(shards) == key(first)
    assert eval_metrics(shards, 2) == eval_metrics(first, 2)
    assert [[x.reward for x in g] for g in unseeded] != [r["rewards"] for r in first]


# -- molt eval on a run's checkpoint -------------------------------------------------------------

def _molt(*args: str):
    """Run the ``molt`` CLI in this process (click's runner): exit code, stdout, stderr."""
    from click.testing import CliRunner

    from molt_core.cli import main

    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return r.exit_code, r.stdout, r.stderr


def test_molt_eval_reports_the_runs_final_pass_at_1(tmp_path):
    out = tmp_path / "run"
    code, _, err = _molt("run", str(_recipe(tmp_path)), "--local", "--out", str(out))
    assert code == 0, err[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    final = rows[-1]
    assert final["step"] == 2 and 0.0 < final["eval/pass@1"] < 1.0  # not a trivial 0 or 1
    ck = out / "checkpoints" / "step_00000002"
    code, stdout, err = _molt("eval", "--model", str(ck))
    assert code == 0, err[-3000:]
    printed = json.loads(stdout.strip().splitlines()[-1])
    rep = json.loads((out / "eval" / "step_00000002.json").read_text())
    assert printed["report"] == str(out / "eval" / "step_00000002.json")
    # exactly the numbers the run logged for that checkpoint
    assert rep["metrics"] == {k: v for k, v in final.items() if k.startswith("eval/")} == rep["logged"]
    assert printed["eval/pass@1"] == final["eval/pass@1"]
    assert rep["model"]["step"] == 2 and rep["n"] == 2 and rep["k"] == 2 and rep["n_problems"] == 8
    assert [t["index"] for t in rep["tasks"]] == list(range(8)) and all(t["n"] == 2 for t in rep["tasks"])
    assert sum(t["correct"] for t in rep["tasks"]) / 16 == final["eval/pass@1"]
    assert "logged eval/pass@1" in err

    # the run directory means its newest intact checkpoint; --n/--k/--out and an explicit recipe
    code, _, err = _molt("eval", str(out / "config.toml"), "--model", str(out), "--n", "4", "--k", "3",
                         "--out", str(tmp_path / "r4.json"))
    assert code == 0, err[-3000:]
    rep4 = json.loads((tmp_path / "r4.json").read_text())
    assert rep4["model"]["checkpoint"] == str(ck) and rep4["n"] == 4 and "eval/pass@3" in rep4["metrics"]
    # samples 0 and 1 of each task are the same draws as with --n 2 (same seeds)
    assert all(t4["correct"] >= t2["correct"] for t4, t2 in zip(rep4["tasks"], rep["tasks"]))

    # a bit-flipped weight file is refused, naming it, before anything loads
    st = ck / "model" / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-1] ^= 1
    st.write_bytes(bytes(data))
    code, _, err = _molt("eval", "--model", str(ck))
    assert code == 2 and "model.safetensors: SHA-256 differs" in err


@pytest.mark.slow
def test_molt_eval_matches_a_ray_run(tmp_path):
    """The same on a run through Ray (subprocesses, two engines sharing the eval tasks)."""
    out = tmp_path / "run"
    r = subprocess.run(MOLT + ["run", str(_recipe(tmp_path)), "--out", str(out), "--set", "engine.num_engines=2"],
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    e = subprocess.run(MOLT + ["eval", "--model", str(out)], env=ENV, capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr[-3000:]
    assert json.loads(e.stdout.strip().splitlines()[-1])["eval/pass@1"] == final["eval/pass@1"]


def test_resolve_model_kinds_and_errors(tmp_path):
    assert resolve_model("http://127.0.0.1:8000/v1/") == {"kind": "url", "path": "http://127.0.0.1:8000/v1"}
    assert resolve_model("builtin:tiny-qwen3") == {"kind": "hf", "path": "builtin:tiny-qwen3"}
    assert resolve_model("Qwen/Qwen3-0.6B") == {"kind": "hf", "path": "Qwen/Qwen3-0.6B"}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "hf")) == {"kind": "hf", "path": str(tmp_path / "hf")}
    with pytest.raises(FileNotFoundError, match="not a checkpoint .* nor a Hugging Face model directory"):
        resolve_model(str(tmp_path))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no intact checkpoint"):
        resolve_model(str(tmp_path / "run"))
    ck = tmp_path / "run" / "checkpoints" / "step_00000001"
    ck.mkdir()
    (ck / "state.json").write_text('{"step": 1}')
    with pytest.raises(CheckpointCorrupt, match="state.json"):
        resolve_model(str(ck))


# -- an OpenAI-compatible URL --------------------------------------------------------------------

def test_eval_over_an_openai_compatible_url(tmp_path):
    """Text-only: the recipe's Env talks to a server (here molt's own, serving the tiny model)
    through the openai SDK; the report says token identity checks do not apply."""
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.server import start_server

    engine = TransformersEngine("builtin:tiny-qwen3", seed=0)
    handle = start_server(engine, engine.tokenizer)
    try:
        sess = handle.create_session()
        cfg = _cfg(tmp_path)
        rep = evaluate(cfg, load_plugins(cfg.plugins), sess.openai_base_url, api_key=sess.api_key, n=2, k=1,
                       out=tmp_path / "url.json")
        traj = handle.trajectory(sess.session_id)
    finally:
        handle.stop()
        engine.close()
    assert rep["model"]["kind"] == "url" and rep["n_problems"] == 8 and rep["metrics"]["eval/failed"] == 0
    assert [t["n"] for t in rep["tasks"]] == [2] * 8
    assert all(len(t["rewards"]) == 2 for t in rep["tasks"])
    assert 0.0 <= rep["metrics"]["eval/pass@1"] <= 1.0 and "token identity" in rep["notes"][0]
    assert json.loads((tmp_path / "url.json").read_text())["metrics"] == rep["metrics"]
    assert traj.num_sampled > 0  # the samples came from the server (8 tasks x 2 samples x 2 turns)


def test_unreachable_url_fails_once_with_a_clear_message(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError, match=rf"--model http://127.0.0.1:{port}/v1: no OpenAI-compatible server answers "
                                         r"there \(APIConnectionError"):
        evaluate(cfg, load_plugins(cfg.plugins), f"http://127.0.0.1:{port}/v1", n=1)


def test_summary_lines():
    from molt_core.cli.evaluate import summary

    rep = {"metrics": {"eval/pass@1": 0.25, "eval/pass@2": 5 / 12, "eval/reward": 0.4, "eval/failed": 1.0},
           "k": 2, "n": 4, "n_problems": 2, "temperature": 1.0, "model": {"step": 7},
           "logged": {"eval/pass@1": 0.25}, "notes": ["text only"]}
    assert summary(rep) == ("pass@1 0.2500  pass@2 0.4167  (2 tasks x 4 samples, T=1.0, failed 1)\n"
                            "  the run logged eval/pass@1 0.2500 at step 7\nnote: text only")
    rep.update(k=1, logged=None, notes=[])
    assert summary(rep) == "pass@1 0.2500  (2 tasks x 4 samples, T=1.0, failed 1)"
