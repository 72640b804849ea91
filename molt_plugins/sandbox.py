"""Run untrusted Python (model-written code) in a limited subprocess.

Each call gets a fresh temporary working directory (deleted afterwards) and a child
``python -I`` process that

* runs in its own session / process group, killed as a group (``SIGKILL``) when the wall
  time limit passes (and ``RLIMIT_CPU`` as a backstop);
* has its address space capped with ``RLIMIT_AS`` (``memory_mb``), core dumps off, and
  written files (stdout/stderr included) capped with ``RLIMIT_FSIZE``;
* has no network: by default in a fresh network namespace (``unshare -n``, or
  ``unshare -rn`` through a user namespace when not root), where no interface but a down
  loopback exists; where namespaces are unavailable, a ``sys.addaudithook`` hook installed
  before the user's code makes every ``socket`` creation, connect and DNS lookup raise
  ``PermissionError``;
* sees a minimal environment (``PATH``, ``HOME``/``TMPDIR`` = the working dir, ``LANG``) --
  no API keys or other variables of the parent.

This is resource control for reward computation, not a security boundary against a
malicious program (no seccomp or filesystem isolation; a grandchild that calls ``setsid``
escapes the group kill). Run untrusted workloads in a container as well.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["SandboxResult", "run_python", "network_isolation", "MEMORY_EXIT_CODE"]

#: Exit code the child uses when the user's code dies of ``MemoryError``.
MEMORY_EXIT_CODE = 86

Status = Literal["ok", "error", "timeout", "memory", "output_limit"]
Isolation = Literal["auto", "namespace", "audit"]

# Runs in the child before the user's program (argv: memory bytes, cpu seconds, file bytes,
# block-net flag). Kept free of imports the user might shadow.
_PRELUDE = r"""
import os, resource, sys
_mem, _cpu, _fsize, _block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if _cpu > 0:
    resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
if _fsize > 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
if _block:
    _NET = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "socket.socketpair"}
    def _no_net(event, args):
        if event in _NET:
            raise PermissionError("network access is disabled in the molt sandbox (" + event + ")")
    sys.addaudithook(_no_net)
if _mem > 0:
    resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
sys.argv = ["main.py"]
sys.path.insert(0, os.getcwd())
import runpy
try:
    runpy.run_path("main.py", run_name="__main__")
except MemoryError:
    try:
        sys.stderr.write("MemoryError: the program exceeded its memory limit\n")
        sys.stderr.flush()
    finally:
        os._exit(%d)
""" % MEMORY_EXIT_CODE


@dataclass
class SandboxResult:
    """Outcome of :func:`run_python`.

    * ``status`` -- ``ok`` (exit 0), ``error`` (non-zero exit or a signal), ``timeout``
      (killed at the wall or CPU time limit), ``memory`` (``MemoryError`` under the
      ``RLIMIT_AS`` cap), ``output_limit`` (a written file passed ``max_output_bytes``).
    * ``returncode`` -- the child's exit status (negative: killed by that signal).
    * ``stdout`` / ``stderr`` -- decoded UTF-8 (errors replaced), each at most
      ``max_output_bytes``.
    * ``duration_s`` -- wall seconds from start to reap.
    * ``isolation`` -- ``namespace`` or ``audit`` (how the network was cut), or ``none``.
    """

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        """True when the program exited 0."""
        return self.status == "ok"

    def reason(self) -> str:
        """A one-line explanation: status, exit code, last stderr line."""
        last = next((ln for ln in reversed(self.stderr.strip().splitlines()) if ln.strip()), "")
        return f"{self.status} (exit {self.returncode}, {self.duration_s:.2f}s){': ' + last[:300] if last else ''}"


@functools.lru_cache(maxsize=None)
def network_isolation() -> tuple[str, tuple[str, ...]]:
    """How this machine cuts the child's network: ``("namespace", prefix_argv)`` when
    ``unshare -n`` (or ``unshare -rn``) works, else ``("audit", ())``. Probed once."""
    exe = shutil.which("unshare")
    if exe:
        for flags in (("-n",), ("-r", "-n")):
            try:
                r = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0:
                return "namespace", (exe, *flags)
    return "audit", ()


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.kill()
    except ProcessLookupError:
        pass


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int | None = 1024,
    network: bool = False,
    isolation: Isolation = "auto",
    files: dict[str, str] | None = None,
    stdin: str | None = None,
    max_output_bytes: int = 1_000_000,
    python: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temp dir under time, memory and network limits.

    Args:
        code: the Python program (source text).
        timeout_s: wall-clock limit in seconds (> 0); the process group is killed at it.
        memory_mb: address-space cap in MiB (``RLIMIT_AS``); None or 0 disables.
        network: allow network access (default False: cut it, see the module docstring).
        isolation: ``auto`` (namespace where available, else audit hook), or force one.
        files: extra files ``{relative_path: text}`` written into the working dir first.
        stdin: text fed to the program's standard input (default: empty).
        max_output_bytes: cap of stdout, stderr and each written file (``RLIMIT_FSIZE``).
        python: interpreter (default ``sys.executable``).

    Returns:
        :class:`SandboxResult`.

    Raises:
        ValueError: ``timeout_s <= 0``, a negative memory cap, a ``files`` path escaping the
            working dir, or ``isolation="namespace"`` where namespaces are unavailable.
        OSError: the interpreter could not be started.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb is not None and memory_mb < 0:
        raise ValueError(f"memory_mb must be >= 0 or None, got {memory_mb}")
    iso_kind, prefix = ("none", ()) if network else network_isolation()
    if not network and isolation == "namespace" and iso_kind != "namespace":
        raise ValueError("isolation='namespace' requested but `unshare -n` does not work here; use 'auto' or 'audit'")
    if not network and isolation == "audit":
        iso_kind, prefix = "audit", ()
    block = iso_kind == "audit"

    work = Path(tempfile.mkdtemp(prefix="molt-sbx-"))
    io_dir = Path(tempfile.mkdtemp(prefix="molt-sbx-io-"))
    try:
        (work / "main.py").write_text(code)
        for rel, text in (files or {}).items():
            dest = (work / rel).resolve()
            if work.resolve() not in dest.parents:
                raise ValueError(f"files: path {rel!r} escapes the sandbox working dir")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        mem = int(memory_mb) * 1024 * 1024 if memory_mb else 0
        cpu = int(timeout_s) + 2
        argv = [*prefix, python or sys.executable, "-I", "-c", _PRELUDE, str(mem), str(cpu),
                str(max_output_bytes), "1" if block else "0"]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        out_p, err_p = io_dir / "stdout", io_dir / "stderr"
        t0 = time.monotonic()
        with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
            p = subprocess.Popen(
                argv, cwd=work, env=env, stdout=out_f, stderr=err_f,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                start_new_session=True, close_fds=True,
            )
            timed_out = False
            try:
                if stdin is not None:
                    try:
                        p.communicate(stdin.encode(), timeout=timeout_s)
                    except BrokenPipeError:
                        p.wait(timeout=max(0.0, timeout_s - (time.monotonic() - t0)))
                else:
                    p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(p)  # also reaps stray children of a finished program
                p.wait()
        dur = time.monotonic() - t0

        def _read(path: Path) -> str:
            with open(path, "rb") as f:
                return f.read(max_output_bytes).decode("utf-8", errors="replace")

        stdout, stderr = _read(out_p), _read(err_p)
        hit_fsize = any(f.stat().st_size >= max_output_bytes for f in (out_p, err_p))
        rc = p.returncode
        if timed_out or rc == -signal.SIGXCPU or rc == -signal.SIGKILL and dur >= timeout_s:
            status: Status = "timeout"
        elif rc == MEMORY_EXIT_CODE or (rc != 0 and stderr.rstrip().splitlines()[-1:] and
                                        stderr.rstrip().splitlines()[-1].startswith("MemoryError")):
            status = "memory"
        elif rc != 0 and (rc == -signal.SIGXFSZ or hit_fsize or "[Errno 27] File too large" in stderr):
            status = "output_limit"
        elif rc == 0:
            status = "ok"
        else:
            status = "error"
        return SandboxResult(status=status, returncode=rc, stdout=stdout, stderr=stderr, duration_s=dur,
                             isolation=iso_kind)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)
