"""Multi-node: a Ray head and a second Ray node on this machine (loopback); `molt run
--ray-address` places the rollout workers on the second node by a custom resource."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
# token auth off: both nodes are on this machine, started by this test
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args):
    return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def nodes(address):
    code = ("import json, ray; ray.init(address=%r, logging_level='error');"
            "print(json.dumps([[n['NodeID'], n['Resources'], n['Alive']] for n in ray.nodes()]))") % address
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else []


def test_rollout_workers_run_on_the_second_node(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start(["--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                  "--include-dashboard=false", '--resources={"trainer_node": 1}'])
    node2 = None
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not nodes(address):
            time.sleep(1)
        node2 = start([f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                       '--resources={"rollout_node": 1}'])
        second = None
        while time.time() < deadline and second is None:
            second = next((n[0] for n in nodes(address) if "rollout_node" in n[1] and n[2]), None)
            time.sleep(1)
        assert second, "the second Ray node did not join"
        out = tmp_path / "mn"
        r = subprocess.run([sys.executable, "-m", "molt_core.cli", "run", "env_agent", "--ray-address", address,
                            "--out", str(out), "--set", "run.steps=2", "--set", "sft.steps=0",
                            "--set", "eval.n_problems=4", "--set", "engine.resources={rollout_node = 1}"],
                           env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        placed = json.loads((out / "placement.json").read_text())["rollout_workers"]
        assert [p["node_id"] for p in placed] == [second]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [0, 1, 2]
        assert all(x["invariants/tokens_retokenized"] == 0 for x in rows[1:])
    finally:
        for p in (node2, head):
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in (node2, head):
            if p is not None:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
