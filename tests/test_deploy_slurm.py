"""deploy/slurm/molt-ray.sbatch against a real Slurm on this machine (slurmctld, munged and two
slurmd -- Slurm nodes n1 and n2, both on 127.0.0.1 -- configured in a temporary directory): a
2-step quickstart through the job's two-node Ray cluster (head on n1, a worker started by srun
on n2) ends COMPLETED with its metrics written, and a cancelled one stops Ray on both nodes and
removes the token and Ray's directories. Where Slurm (Debian: ``apt-get install slurm-wlm``) is missing or will not start, the
tests skip with a warning that says so."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "slurm" / "molt-ray.sbatch"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "squeue")
QUICKSTART = ["quickstart", "--steps", "2", "--sft-steps", "20", "--set", "eval.n_problems=16"]


def loud_skip(why: str) -> None:
    """Skip with the reason in pytest's warnings summary too (shown without ``-rs``)."""
    msg = f"SLURM TESTS SKIPPED: {why}"
    warnings.warn(msg, UserWarning, stacklevel=2)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin")


NODES = ("n1", "n2")


def slurm_conf(d: Path, user: str, cpus: int) -> str:
    """Two Slurm nodes on this machine (one slurmd each, on its own port, spool and log), no
    accounting database (job states from ``scontrol``, kept an hour by MinJobAge), no cgroups."""
    nodes = "\n".join(f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={free_port()} "
                      f"CPUs={cpus} RealMemory=1000 State=UNKNOWN" for n in NODES)
    return f"""ClusterName=molttest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=3600
KillWait=90
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def log_tail(d: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((d / "log").glob("*")))


@pytest.fixture(scope="module")
def slurm():
    """Start munged, slurmctld and the two slurmd for this module; yields ``(env, dir)`` (``env`` has
    ``SLURM_CONF``); stops them after."""
    missing = [t for t in TOOLS if which(t) is None]
    if missing:
        loud_skip(f"{', '.join(missing)} not installed (Debian: apt-get install slurm-wlm munge)")
    # short: Ray's unix sockets live under the job's TMPDIR (108-byte path limit)
    d = Path(tempfile.mkdtemp(prefix="mslurm", dir="/tmp"))
    for sub in ("munge", "state", "spool", "log", "tmp", *(f"spool/{n}" for n in NODES)):
        (d / sub).mkdir(mode=0o700)
    os.chmod(d, 0o755)
    key = d / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    user = pwd.getpwuid(os.getuid()).pw_name
    conf = d / "slurm.conf"
    conf.write_text(slurm_conf(d, user, max(2, os.cpu_count() or 1)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    try:
        m = d / "munge"
        r = subprocess.run([which("munged"), "--force", f"--key-file={key}", f"--socket={m}/sock",
                            f"--pid-file={m}/pid", f"--log-file={d}/log/munged.log", f"--seed-file={m}/seed"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode:
            loud_skip(f"munged did not start: {r.stderr.strip()[-500:]}")
        started.append(m / "pid")
        daemons = [("slurmctld", [], "slurmctld.pid")] + [("slurmd", ["-N", n], f"slurmd-{n}.pid") for n in NODES]
        for daemon, extra, pidfile in daemons:
            r = subprocess.run([which(daemon), "-f", str(conf), *extra], env=env, capture_output=True, text=True,
                               timeout=60)
            if r.returncode:
                loud_skip(f"{daemon} {' '.join(extra)} did not start: {r.stderr.strip()[-500:]}\n{log_tail(d)}")
            started.append(d / pidfile)
        deadline = time.time() + 60
        while time.time() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            if r.stdout.split() == ["idle"]:
                break
            time.sleep(1)
        else:
            loud_skip(f"the Slurm node never became idle (sinfo: {r.stdout.strip()!r} {r.stderr.strip()!r})\n"
                      f"{log_tail(d)}")
        yield env, d
    finally:
        # a job still running (a failed test) is cancelled, so no slurmstepd or Ray outlives the daemons
        if len(started) == 2 + len(NODES):
            subprocess.run(["scancel", "--user", user], env=env, capture_output=True, timeout=30)
            deadline = time.time() + 60
            while time.time() < deadline and subprocess.run(
                    ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30).stdout.strip():
                time.sleep(1)
        for pidfile in reversed(started):
            try:
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(1)
        shutil.rmtree(d, ignore_errors=True)


UMASK = 0o022


def job_env(env: dict[str, str], d: Path) -> dict[str, str]:
    """What the job inherits through sbatch: this interpreter's bin first (python3, ray,
    molt), quiet single-threaded offline settings, and a short TMPDIR."""
    bindir = str(Path(sys.executable).parent)
    return {**env, "PATH": f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}", "TMPDIR": str(d / "tmp"),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "MOLT_RAY_TIMEOUT": "120"}


def job(env: dict[str, str], job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, ExitCode, ...)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def submit(env: dict[str, str], d: Path, name: str, args: list[str], nodes: int = 1) -> tuple[str, Path]:
    log = d / f"{name}.out"
    r = subprocess.run(["sbatch", "--parsable", "--job-name", name, "--nodes", str(nodes), "--cpus-per-task", "2",
                        "-D", str(d),
                        "-o", str(log), str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.umask(UMASK))  # Slurm runs the job with the submitter's umask
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0], log


def wait_state(env: dict[str, str], job_id: str, done, timeout: float) -> dict[str, str]:
    deadline = time.time() + timeout
    info = job(env, job_id)
    while not done(info) and time.time() < deadline:
        time.sleep(1)
        info = job(env, job_id)
    return info


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def ray_processes(marker: str) -> list[str]:
    """Command lines of the processes that mention ``marker`` (a job's temp directory)."""
    out = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if marker in ln and "ps -eww" not in ln]


def test_sbatch_quickstart_through_a_two_node_ray_cluster_completes(slurm):
    env, d = slurm
    env = job_env(env, d)
    out = d / "run-quickstart"
    job_id, log = submit(env, d, "molt-qs", [*QUICKSTART, "--out", str(out)], nodes=2)
    info = wait_state(env, job_id, lambda i: i.get("JobState") in ENDED, 600)
    text = log.read_text() if log.exists() else ""
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), f"{info}\n{text[-4000:]}"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the run's own files keep the submitter's umask (022), unlike the token
    assert (out / "metrics.jsonl").stat().st_mode & 0o777 == 0o666 & ~UMASK
    assert "molt-ray: 2 Ray node(s) up" in text
    assert "molt-ray: molt run exited 0" in text and "molt-ray: Ray stopped (exit 0)" in text
    # the job joined its own cluster (this host's first address, or 127.0.0.1), not a local one
    head = re.search(r"molt-ray: head n1 at ([\d.]+:\d+), 2 node\(s\), 2 CPU\(s\) and 0 GPU\(s\)", text)
    assert head and f"starting Ray (joining {head[1]})" in text, text[-4000:]
    # the token directory and Ray's session under it are gone, and no Ray process outlived the job
    # (head: molt-JOBID.*, the worker on n2: molt-ray.*)
    assert list((d / "tmp").glob(f"molt-{job_id}.*")) == [] and list((d / "tmp").glob("molt-ray.*")) == []
    assert ray_processes(str(d / "tmp")) == []


def test_cancelled_job_stops_ray_and_removes_its_token(slurm):
    env, d = slurm
    env = job_env(env, d)
    out = d / "run-cancel"
    job_id, log = submit(env, d, "molt-cancel", ["quickstart", "--steps", "300", "--out", str(out)], nodes=2)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "config.toml").exists():
        assert job(env, job_id).get("JobState") in ("PENDING", "RUNNING"), log.read_text()[-4000:]
        time.sleep(1)
    assert (out / "config.toml").exists(), log.read_text()[-4000:]
    # while it runs: one private directory holding the token, readable by this user only
    (tmp,) = (d / "tmp").glob(f"molt-{job_id}.*")
    assert tmp.stat().st_mode & 0o777 == 0o700
    token = tmp / "token"
    assert token.stat().st_mode & 0o777 == 0o600
    secret = token.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    assert ray_processes(tmp.name), "no Ray process runs under the job's temp directory"
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=30)
    # generous waits: on a loaded machine (the whole suite on 2 cores) Ray takes tens of seconds to stop,
    # and a stop slower than KillWait is SIGKILLed before the script can log it
    info = wait_state(env, job_id, lambda i: i.get("JobState") in ENDED, 240)
    assert info.get("JobState") == "CANCELLED", info
    deadline = time.time() + 120
    while time.time() < deadline and (tmp.exists() or ray_processes(str(d / "tmp"))):
        time.sleep(1)
    text = log.read_text()
    assert "molt-ray: cancelled" in text and "molt-ray: Ray stopped (exit 143)" in text, text[-4000:]
    assert not tmp.exists() and list((d / "tmp").glob("molt-ray.*")) == []
    assert ray_processes(str(d / "tmp")) == []
    assert secret not in text
