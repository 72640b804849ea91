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
        assert len(r["rewards"]) == 3 and len(r["step_s"]) == 3
        assert all(0.0 <= x <= 1.0 for x in r["rewards"])
        assert r["summary"]["steps_to_target"] == 2  # target 0.0 is met by the first full 2-step window
        assert set(r["final_eval"]) == {"greedy", "sampled"}
    assert per["molt"]["invariants"] == {"staleness_max": 0.0, "tokens_retokenized": 0.0}
    assert per["molt_async"]["invariants"]["staleness_max"] <= 1.0
    assert set(res["summary"]["ratios"]) == {"molt/trl", "molt/plain", "trl/plain", "molt_async/molt", "molt_async/trl"}
    assert res["summary"]["ratios"]["molt/plain"]["step_time"]["n"] == 1
