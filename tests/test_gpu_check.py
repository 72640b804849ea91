"""benchmarks/gpu_check.py, the prepared GPU check of issue 14, runs end to end on CPU
(``--allow-cpu``: gloo instead of NCCL, the builtin tiny Qwen3, bf16 on CPU) and writes the
JSON a GPU machine would: the sync part (processes, exact bf16 weights, a wrong version
refused), the bf16 part (clean within the documented bound, other weights flagged), the fsdp
part (2 sharded ranks == 1 rank) and the RL
part (``molt run --local`` here, as on a GPU machine without vLLM or Ray), with the figures it
reports (tokens/s, step time, ``time/sync``, bytes per sync)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # three parts, two spawned processes and a 1-step run: ~3 min on 2 cores
def test_gpu_check_runs_on_cpu_and_reports(tmp_path):
    out = tmp_path / "gc"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--allow-cpu", "--out", str(out),
           "--steps", "1", "--prompts", "2", "--reps", "2", "--n-rollouts", "4", "--no-peer"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "gpu_check.json").read_text())
    assert rep["failed"] == [] and rep["policy"] == "builtin:tiny-qwen3"
    sync, bf16, rl = (rep["parts"][k] for k in ("sync", "bf16", "rl"))
    n = 853_376  # tiny-qwen3's distinct parameters; sent as bf16, padded to 8 bytes per buffer
    assert sync["backend"] == "gloo" and sync["bytes_per_sync"] == 2 * n and sync["exact"] and sync["tensors"] == 46
    assert sync["fault_refused"] and sync["after_fault_ok"] and sync["seconds_per_sync"] > 0
    t = bf16["transformers"]
    assert bf16["master_dtype"] == "torch.float32" and t["within_tol"] and t["fault_flagged"]
    assert 0 < t["clean_max"] <= bf16["tolerance"] < t["other_weights_max"]
    run = rl.get("collective") or rl["ray_peer"]
    (step,) = run["steps"]
    assert step["sync/bytes"] == 2 * n and step["time/sync"] > 0 and step["tokens_per_s"] > 0
    assert step["rollout/failed"] == 0 and step["invariants/logprob_absdiff_max_onpolicy"] <= bf16["tolerance"]
    fsdp = rep["parts"]["fsdp"]  # the 1-vs-2-rank parity (NCCL on 2 GPUs; gloo here)
    assert fsdp["status"] == "ok" and fsdp["backend"] == "gloo" and fsdp["out_of_tolerance"] == []
    assert fsdp["weights_max_abs_diff"] <= fsdp["weights_tol"] and fsdp["grad_norm_1_rank"][0] > 0.5  # clip active
