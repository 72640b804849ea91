"""Smoke test of ``benchmarks/bench_quickstart.py``: a few steps of every arm run and the
result file carries per-step rewards, step times, evals, invariants and same-run ratios.
No timing is asserted (speed targets live only in the benchmark's own output)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_quickstart_smoke(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_quickstart.py"), "--steps", "3", "--window", "2",
           "--warmup", "0", "--seeds", "1", "--target", "0.0", "--sft-steps", "2", "--sft-dir", str(tmp_path / "sft"),
           "--eval-problems", "4", "--out", str(out), "--no-plot"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench_quickstart.json").read_text())
    per = res["seeds"]["0"]
    assert set(per) == {"molt", "molt_async", "trl", "plain"}
    for arm, r in per.items():
        assert "error" not in r, (arm, r.get("error"))
        assert len(r["rewards"]) == 3 and len(r["step_s"]) == 3 and len(r["paused"]) == 3
        assert all(0.0 <= x <= 1.0 for x in r["rewards"])
        assert r["summary"]["steps_to_target"] == 2  # target 0.0 is met by the first full 2-step window
        assert set(r["final_eval"]) == {"greedy", "sampled"}
    assert per["molt"]["invariants"] == {"staleness_max": 0.0, "tokens_retokenized": 0.0, "rollouts_failed": 0.0}
    assert per["molt_async"]["invariants"]["rollouts_failed"] == 0.0
    assert per["molt_async"]["invariants"]["staleness_max"] <= 1.0
    assert set(res["summary"]["ratios"]) == {"molt/trl", "molt/plain", "trl/plain", "molt_async/molt", "molt_async/trl"}
    assert res["summary"]["ratios"]["molt/plain"]["step_time"]["n"] == 1


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_quickstart", ROOT / "benchmarks" / "bench_quickstart.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_unpause_takes_stopped_time_out_of_each_step():
    bq = _bench()
    bounds = [[0.0, 1.0], [1.0, 3.0], [3.0, 4.0], [4.0, 6.0]]
    pauses = [[1.5, 2.0], [5.0, 5.25]]
    secs, paused = bq.unpause(bounds, pauses)
    assert secs == [1.0, 1.5, 1.0, 1.75]
    assert paused == [False, True, False, True]
    # a pause that straddles two steps is split between them
    secs, paused = bq.unpause([[0.0, 2.0], [2.0, 4.0]], [[1.0, 3.0]])
    assert secs == [1.0, 1.0] and paused == [True, True]


def test_interleaved_arms_never_run_while_stopped(tmp_path):
    """Two arms taking 0.3 s turns: neither logs a line while it is stopped, and each was stopped."""
    bq = _bench()
    code = "import time\nfor _ in range(120):\n    print(time.time(), flush=True)\n    time.sleep(0.01)\n"
    cmds = {a: ([sys.executable, "-c", code], None, tmp_path / f"{a}.log") for a in ("a", "b")}
    runs = bq.run_arm_processes(cmds, 0.3, 60.0)
    for a in ("a", "b"):
        assert runs[a]["rc"] == 0
        assert runs[a]["pauses"] and all(e is not None for _, e in runs[a]["pauses"])
        stamps = [float(x) for x in (tmp_path / f"{a}.log").read_text().split()]
        assert len(stamps) == 120
        inside = [t for t in stamps for s, e in runs[a]["pauses"] if s + 0.05 < t < e - 0.05]
        assert inside == [], (a, inside[:3])
    # one after another: no pauses at all
    runs = bq.run_arm_processes(cmds, 0.0, 60.0)
    assert all(r["rc"] == 0 and r["pauses"] == [] for r in runs.values())


def test_an_arm_keeps_its_first_turn_until_it_is_ready(tmp_path):
    """Ray's start-up has wall-clock timeouts: a molt arm is not stopped before its ready file
    (its first metrics row) is written, however short the turns."""
    bq = _bench()
    flag = tmp_path / "ready"
    slow = ("import sys, time\nt = time.time()\nwhile time.time() - t < 1.0:\n    pass\n"
            "open(sys.argv[1], 'w').write('x')\ntime.sleep(0.6)\n")
    cmds = {"a": ([sys.executable, "-c", slow, str(flag)], None, tmp_path / "a.log"),
            "b": ([sys.executable, "-c", "import time; time.sleep(0.6)"], None, tmp_path / "b.log")}
    runs = bq.run_arm_processes(cmds, 0.2, 60.0, ready={"a": flag})
    assert runs["a"]["rc"] == 0 == runs["b"]["rc"]
    assert runs["a"]["pauses"], "a was never stopped after it was ready"
    assert runs["a"]["pauses"][0][0] >= flag.stat().st_mtime


_STAMPER = "import time\nfor _ in range(150):\n    print(time.time(), flush=True)\n    time.sleep(0.01)\n"


def _tree_arm(log):
    """An arm whose work is done two processes below it (as Ray's workers are below ``molt run``):
    root -> middle -> stamper, the stamper writing wall-clock stamps to ``log``."""
    middle = ("import subprocess, sys\n"
              f"with open({str(log)!r}, 'w') as f:\n"
              f"    sys.exit(subprocess.call([sys.executable, '-c', {_STAMPER!r}], stdout=f))\n")
    root = f"import subprocess, sys\nsys.exit(subprocess.call([sys.executable, '-c', {middle!r}]))\n"
    return [sys.executable, "-c", root]


def test_the_whole_process_tree_is_stopped(tmp_path, monkeypatch):
    """The stamps of a grandchild never fall inside its arm's pauses; with only the arm's own
    process stopped (the fault) they do."""
    bq = _bench()

    def stamps_inside(tag):
        cmds = {a: (_tree_arm(tmp_path / f"{tag}{a}.stamps"), None, tmp_path / f"{tag}{a}.log") for a in ("a", "b")}
        runs = bq.run_arm_processes(cmds, 0.3, 60.0)
        inside = []
        for a in ("a", "b"):
            assert runs[a]["rc"] == 0 and runs[a]["pauses"]
            stamps = [float(x) for x in (tmp_path / f"{tag}{a}.stamps").read_text().split()]
            assert len(stamps) == 150
            inside += [t for t in stamps for s, e in runs[a]["pauses"] if s + 0.05 < t < e - 0.05]
        return inside

    assert stamps_inside("ok") == []
    real = bq.tree_signal

    def root_only(root, sig):  # the fault: descendants are never signalled
        root.send_signal(sig)

    monkeypatch.setattr(bq, "tree_signal", lambda root, sig: root_only(root, sig) if sig != bq.signal.SIGKILL
                        else real(root, sig))
    assert stamps_inside("fault") != []


def test_an_arm_left_alone_is_not_stopped(tmp_path):
    """Once the other arms have ended, the last one runs on without being stopped and
    continued every turn (each stop would put a step out of the medians for nothing)."""
    bq = _bench()
    long = "import time\nt = time.time()\nwhile time.time() - t < 2.5:\n    time.sleep(0.01)\n"
    short = "import time\ntime.sleep(0.05)\nprint(time.time(), flush=True)\n"
    cmds = {"a": ([sys.executable, "-c", long], None, tmp_path / "a.log"),
            "b": ([sys.executable, "-c", short], None, tmp_path / "b.log")}
    runs = bq.run_arm_processes(cmds, 0.5, 60.0)
    assert runs["a"]["rc"] == 0 == runs["b"]["rc"]
    b_end = float((tmp_path / "b.log").read_text())
    assert runs["a"]["pauses"], "a was never stopped while b ran"
    assert [s for s, _ in runs["a"]["pauses"] if s > b_end + 0.2] == []


def test_a_molt_arm_reports_failed_rollouts_and_its_deadline_outlasts_a_stop(tmp_path):
    """A rollout's deadline is wall clock, which runs on while its arm is stopped: the molt
    arms get a deadline of the arm timeout (not the recipe's 60 s, which another arm's Ray
    start-up turn can outlast), and any failed rollout is counted with the invariants."""
    import argparse

    bq = _bench()
    args = argparse.Namespace(steps=3, threads=1, arm_timeout=3600.0)
    cmd = bq.molt_command(args, tmp_path / "sft" / "model", 0, 1, tmp_path)
    assert cmd[cmd.index("rollout.timeout_s=3600.0") - 1] == "--set"
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "state.json").write_text("{}")
    rows = [{"step": s, "reward/mean": 0.5, "time/step": 0.3, "time/step_end_unix": 100.0 + s, "rollout/failed": f,
             "invariants/staleness_max": 1.0, "invariants/tokens_retokenized": 0.0} for s, f in ((1, 0.0), (2, 3.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = bq.collect_molt(tmp_path)
    assert res["invariants"] == {"staleness_max": 1.0, "tokens_retokenized": 0.0, "rollouts_failed": 3.0}
    assert res["bounds"] == [[100.7, 101.0], [101.0, 102.0]]
