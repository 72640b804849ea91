"""`molt run` on the console and across a kill (issue 13 items 3, 6, 7): the run directory
first, no ANSI codes when redirected, the SFT warm start's progress and checkpoint, --resume
checking for a checkpoint before Ray, the first rollout failure's traceback once."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from molt_core.cli import main
from molt_core.cli.recipe import load_config

MOLT = [sys.executable, "-m", "molt_core.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--set", "eval.n_problems=2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.n_samples_per_prompt=2",
         "--set", "sft.batch_size=4", "--set", "sft.n_examples=16", "--set", "checkpoint.every=100"]


def steps_of(run_dir):
    return [json.loads(x)["step"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_step_progress_plain_lines_when_not_a_terminal():
    from molt_core.train.progress import step_progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with step_progress(console, "SFT warm start", 20, lines=4) as update:
        for i in range(1, 21):
            update(i, f"loss {1 / i:.3f}")
    lines = buf.getvalue().splitlines()
    assert [re.match(r"SFT warm start: (\d+)/20 loss ", x).group(1) for x in lines] == ["5", "10", "15", "20"]
    assert all(re.search(r"\(\d+\.\d steps/s, ETA \d+ s\)$", x) for x in lines)
    assert "\x1b[" not in buf.getvalue()


def test_resume_without_checkpoint_says_what_to_do_before_ray_starts(tmp_path, monkeypatch):
    """What a kill during the SFT warm start leaves: config.toml, no checkpoint."""
    import molt_core.runtime.loop as loop

    def no_ray(*a, **k):
        raise AssertionError("Ray was started before the checkpoint check")

    monkeypatch.setattr(loop, "init_ray", no_ray)
    run = tmp_path / "run"
    run.mkdir()
    load_config("env_agent", ["sft.steps=5"]).write(run / "config.toml")
    res = CliRunner().invoke(main, ["run", "--resume", str(run)])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert f"no checkpoint in {run / 'checkpoints'}" in out and "after the SFT warm start" in out
    assert (f"Start it again in a new run directory: molt run {run / 'config.toml'} "
            f"--out {run.with_name(run.name + '-restart')}") in " ".join(out.split())
    assert "Ray was started" not in out


def wait_for(pred, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_resume_from_the_warm_start_checkpoint_skips_sft(tmp_path):
    """In-process: a run whose only checkpoint is the warm start's (step 0; the step-1
    checkpoint removed as if the run died before writing it) resumes without SFT."""
    import shutil

    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", "quickstart", "--local", "--out", str(run), "--steps", "1", "--sft-steps", "3",
                                    *SMALL])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == f"run directory: {run}"
    assert "SFT warm start: 3/3 loss " in res.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000000", "step_00000001"]
    shutil.rmtree(run / "checkpoints" / "step_00000001")
    res = CliRunner().invoke(main, ["run", "--resume", str(run), "--local", "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert "from step_00000000 (the SFT warm start)" in res.output and "SFT warm start:" not in res.output
    assert steps_of(run) == [0, 1, 2]  # the start eval (step 0) is not redone, step 1 is redone once


@pytest.mark.slow  # two process starts and a SIGKILL, ~30-60 s on 2 cores
def test_kill_after_the_sft_warm_start_then_resume_skips_it(tmp_path):
    """A run killed (SIGKILL) after its warm start resumes from the warm-start checkpoint:
    no SFT again, the RL steps once each; the console shows the run directory first,
    the warm start's progress, and no ANSI codes (output redirected)."""
    run = tmp_path / "run"
    args = MOLT + ["run", "quickstart", "--local", "--out", str(run), "--steps", "400", "--sft-steps", "10", *SMALL]
    p = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: (run / "checkpoints" / "step_00000000" / "checksums.json").is_file(), p)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    first = p.stderr.read().decode()
    assert first.splitlines()[0] == f"run directory: {run}"
    assert "SFT warm start: 10/10 loss " in first and "steps/s, ETA" in first
    assert "\x1b[" not in first
    r = subprocess.run(MOLT + ["run", "--resume", str(run), "--local", "--steps", "2"], env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines()[0] == f"run directory: {run}"
    assert "resuming" in r.stderr and "from step_00000000 (the SFT warm start)" in r.stderr
    assert "SFT warm start:" not in r.stderr  # no progress line, no loss line: the warm start did not run
    assert "\x1b[" not in r.stderr
    assert steps_of(run) == [0, 1, 2]


def _final_weights(run):
    from safetensors.torch import load_file

    d = run / "checkpoints" / "step_00000000" / "model"
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_kill_during_the_sft_warm_start_then_resume_continues_it_bit_exact(tmp_path, monkeypatch):
    """Issue 28 item 5: a run killed during its warm start (sft.checkpoint_every = 2 of 6 steps; the
    driver dies in step 4) resumes from step 2's checkpoint with its AdamW state and data cursor: the
    losses of steps 3..6 and the final weights equal an uninterrupted warm start's, bit for bit."""
    from molt_core.runtime.workers import TrainerWorker

    real, losses, die_after = TrainerWorker.sft_next, [], [None]

    def sft_next(self, k):
        if die_after[0] is not None and len(losses) >= die_after[0]:
            raise RuntimeError("killed")
        ms = real(self, k)
        losses.extend(m["sft/loss"] for m in ms)
        return ms

    monkeypatch.setattr(TrainerWorker, "sft_next", sft_next)
    args = ["run", "quickstart", "--local", "--sft-steps", "6", *SMALL, "--set", "run.steps=0",
            "--set", "sft.checkpoint_every=2"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    res = CliRunner().invoke(main, [*args, "--out", str(whole)])
    assert res.exit_code == 0, res.output
    full, losses[:] = list(losses), []
    assert len(full) == 6
    die_after[0] = 3  # steps 1..3 run, step 2's checkpoint written, the kill comes before step 4
    res = CliRunner().invoke(main, [*args, "--out", str(cut)])
    assert res.exit_code != 0 and "SFT warm start: loss" not in res.output
    state = json.loads((cut / "checkpoints" / "step_00000000" / "state.json").read_text())
    assert state["data_cursor"] == {"step": 0, "tasks": 0, "untrained": [], "sft": 2}
    assert losses == full[:3]
    die_after[0], losses[:] = None, []
    res = CliRunner().invoke(main, ["run", "--resume", str(cut), "--local"])
    assert res.exit_code == 0, res.output
    assert "from step_00000000 (step 2 of the SFT warm start)" in res.output
    assert losses == full[2:]  # step 3 is redone (it was lost with the kill), then 4..6
    assert f"SFT warm start: loss {full[2]:.3f} -> {full[-1]:.3f}" in res.output
    state = json.loads((cut / "checkpoints" / "step_00000000" / "state.json").read_text())
    assert state["data_cursor"] == {"step": 0, "tasks": 0, "untrained": []}  # the warm start's own, complete
    a, b = _final_weights(whole), _final_weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    res = CliRunner().invoke(main, ["run", "--resume", str(cut), "--local"])  # now: no warm start again
    assert res.exit_code == 0 and "from step_00000000 (the SFT warm start)" in res.output
    assert "SFT warm start:" not in res.output and len(losses) == 4


RAISING_AGENT = '''
from molt_core.agents import Env
from molt_core.types import Result

def grade(action):
    raise RuntimeError("grader exploded on " + repr(action[:5]))

class Broken(Env):
    def tasks(self, split, seed):
        i = 0
        while True:
            yield {"i": i, "answer": "1"}
            i += 1
    def reset(self, task):
        return "What is 0 + 1?"
    def step(self, action_text, state):
        return Result(reward=grade(action_text), terminated=True)
'''


def test_a_crashing_agent_shows_its_first_traceback_once_and_the_eval_says_it_failed(tmp_path):
    agent = tmp_path / "broken.py"
    agent.write_text(textwrap.dedent(RAISING_AGENT))
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", "env_agent", "--agent", str(agent), "--local", "--out", str(run),
                                    "--steps", "2", "--sft-steps", "0", "--set", "eval.n_problems=3",
                                    "--set", "rollout.prompts_per_step=2", "--set", "rollout.n_samples_per_prompt=2"])
    assert res.exit_code == 1, res.output  # every step trained on nothing
    out = res.output
    assert out.count("Traceback (most recent call last)") == 1  # 3 eval + 8 train + 3 eval failures: one traceback
    assert re.search(r'in grade\n\s+raise RuntimeError\("grader exploded on "', out)
    assert "eval at start: all 3 eval rollouts failed (no pass@1)" in out
    assert "pass@1 0.000" not in out
    assert "\x1b[" not in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/failed"] == 3.0 and rows[0]["eval/rollouts"] == 3.0
    first = json.loads((run / "trajectories.jsonl").read_text().splitlines()[0])
    assert first["status"] == "failed" and "grader exploded" in first["info"]["traceback"]
