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
    assert per["molt"]["invariants"] == {"staleness_max": 0.0, "tokens_retokenized": 0.0}
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
