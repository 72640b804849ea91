"""`molt run` with ``trainer.world_size = 2`` end to end on a local Ray cluster: two trainer
ranks in a placement group, killed with SIGKILL mid-run and resumed from the sharded
checkpoint (distributed checkpoint + Hugging Face directory)."""

import json
import os
import signal
import subprocess
import time

import pytest
from test_main_job import ENV, MOLT, check_invariants, rows


@pytest.mark.slow  # two Ray runs with 2 trainer ranks: ~3 min on 2 cores
def test_two_rank_run_killed_then_resumed(tmp_path):
    out = tmp_path / "ws2"
    args = MOLT + ["run", "env_agent", "--out", str(out), "--set", "trainer.world_size=2", "--set", "run.steps=12",
                   "--set", "sft.steps=0", "--set", "eval.n_problems=0", "--set", "checkpoint.every=2",
                   "--set", "checkpoint.keep=2"]
    p = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    ck = out / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline:
        if ck.is_dir() and any(d.name >= "step_00000004" for d in ck.glob("step_*")):
            break
        assert p.poll() is None, p.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)  # the driver and every Ray process it started
    p.wait()
    assert max(r["step"] for r in rows(out)) < 12
    ranks = json.loads((out / "placement.json").read_text())["trainer_ranks"]
    assert [r["rank"] for r in ranks] == ["0", "1"] and {r["backend"] for r in ranks} == {"gloo"}
    assert len({r["pid"] for r in ranks}) == 2  # one process per rank
    line = (f"trainer: 2 ranks (gloo): rank 0 on {ranks[0]['hostname']} pid {ranks[0]['pid']}, "
            f"rank 1 on {ranks[1]['hostname']} pid {ranks[1]['pid']}")
    assert line in p.stderr.read().decode()  # the console names the ranks

    r = subprocess.run(MOLT + ["run", "--resume", str(out)], env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    rs = rows(out)
    assert [x["step"] for x in rs] == list(range(1, 13))  # every step once, the curve continues
    assert [x["policy_version"] for x in rs] == [float(s) for s in range(1, 13)]
    steps = check_invariants(rs, 0)
    assert all(s["sync/bytes"] > 0 and s["time/sync"] > 0 for s in steps[1:])
    last = ck / "step_00000012"
    assert (last / "dcp" / ".metadata").is_file() and (last / "model" / "config.json").is_file()
    assert json.loads((last / "state.json").read_text())["world_size"] == 2
