"""Issue 11, done-when: `molt run quickstart --local` with one reward that returns NaN on 10%
of calls and another that sleeps past its timeout on 10% of calls finishes, with exactly
those rollouts counted failed (per step, per reward, and in eval). Which calls fail is a
hash of the task's question, so the expected counts are computed here independently."""

from __future__ import annotations

import hashlib
import itertools
import json
import textwrap

from click.testing import CliRunner

PLUGIN = '''
import hashlib, math, time
from molt_core.hookspecs import hookimpl

def hit(task, salt):
    """True on ~10% of tasks: a hash of the question (deterministic)."""
    return int(hashlib.sha256((salt + task["question"]).encode()).hexdigest(), 16) % 10 == 0

def nan10(response, task):
    return math.nan if hit(task, "nan") else 0.5

def slow10(response, task):
    if hit(task, "slow"):
        time.sleep(3.0)  # past timeout_s = 0.3: a sync reward cannot be killed, the step must not wait
    return 0.25

@hookimpl
def molt_register_rewards(register):
    register("nan10", nan10)
    register("slow10", slow10)
'''


def hit(task, salt):
    return int(hashlib.sha256((salt + task["question"]).encode()).hexdigest(), 16) % 10 == 0


def test_quickstart_with_nan_and_slow_rewards_counts_exactly_those_failed(tmp_path):
    from molt_core.cli import main
    from molt_core.cli.recipe import load_config
    from molt_core.plugins import load_plugins
    from molt_core.runtime import load_agent

    plug = tmp_path / "flaky_rewards.py"
    plug.write_text(textwrap.dedent(PLUGIN))
    steps, P, n, n_eval = 4, 8, 4, 16
    sets = [f"run.steps={steps}", "sft.steps=0", f"eval.n_problems={n_eval}", "checkpoint.every=0",
            f"rollout.prompts_per_step={P}", f"rollout.n_samples_per_prompt={n}", "rollout.max_tokens=4",
            "rewards.nan10={weight = 2.0}", "rewards.slow10={timeout_s = 0.3}"]
    out = tmp_path / "run"
    args = ["run", "quickstart", "--local", "--plugin", str(plug), "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-3000:]
    rows = {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    cfg = load_config("quickstart", sets)
    agent = load_agent(cfg, load_plugins(cfg.plugins))
    train = list(itertools.islice(agent.tasks("train", cfg.run.seed), steps * P))
    n_nan = n_slow = 0
    for s in range(1, steps + 1):
        tasks = train[(s - 1) * P:s * P]
        nan_t, slow_t = [hit(t, "nan") for t in tasks], [hit(t, "slow") for t in tasks]
        row = rows[s]
        assert row["rollout/failed"] == n * sum(a or b for a, b in zip(nan_t, slow_t)), s
        assert row["reward/nan10/failed"] == n * sum(nan_t), s
        assert row["reward/slow10/failed"] == n * sum(slow_t), s
        assert row["time/rollout"] < 3.0, s  # the step never waits out the 3 s sleep
        if row["reward/nan10/mean"] is not None:
            assert row["reward/nan10/mean"] == 0.5 and row["reward/slow10/mean"] == 0.25
        n_nan, n_slow = n_nan + sum(nan_t), n_slow + sum(slow_t)
    assert n_nan >= 1 and n_slow >= 1, (n_nan, n_slow)  # the run really met both faults
    evals = list(itertools.islice(agent.tasks("eval", cfg.run.seed), n_eval))
    bad_eval = sum(hit(t, "nan") or hit(t, "slow") for t in evals)
    assert rows[0]["eval/failed"] == bad_eval and rows[steps]["eval/failed"] == bad_eval
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    errors = {t["error"] for t in trajs if t["status"] == "failed"}
    assert errors <= {"reward nan10: failed: non_finite (reward nan10 returned nan; a reward must be a finite number)",
                      "reward slow10: failed: timeout (no score within 0.3 s (rewards.slow10.timeout_s))"}
