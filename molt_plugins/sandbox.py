"""Run untrusted Python (model-written code) in an isolated, limited subprocess.

Each call gets a fresh temporary working directory (deleted afterwards) and runs, under one
of three local **backends** (the first available one is used; see :func:`sandbox_backend`):

* ``bwrap`` -- `bubblewrap <https://github.com/containers/bubblewrap>`_, when installed: new
  PID, IPC, UTS (and network) namespaces, ``--die-with-parent``, the whole filesystem bound
  read-only except the working dir, a fresh ``/proc`` and minimal ``/dev``;
* ``unshare`` -- util-linux ``unshare`` (new PID, mount and network namespaces,
  ``--kill-child``); the supervisor below makes every mount read-only except the working dir;
* ``process`` -- no namespaces: a new session, ``PR_SET_CHILD_SUBREAPER`` so that every
  descendant (a ``setsid`` grandchild included) stays findable and is killed, network cut by
  ``unshare -n`` where that alone works, else by an audit hook.

In every backend a small supervisor (``python -I``) starts first and forks the program; the
program

* runs as uid/gid 65534 (``nobody``), groups cleared, ``no_new_privs`` set, when the caller is
  root and the interpreter is reachable for that uid (always in ``bwrap`` / ``unshare``, which
  re-mount a hidden interpreter prefix such as ``/root/.pyenv/...`` readable); so it cannot
  read other processes' ``/proc/<pid>/environ`` or signal them, and ``RLIMIT_NPROC`` bounds
  its process (and thread) count to ``max_processes``;
* sees only its own processes in ``/proc`` (``bwrap``, ``unshare``: PID namespace);
* can write only to its working directory (``bwrap``, ``unshare``: read-only mounts elsewhere,
  ``/dev/shm`` a private tmpfs under ``bwrap``; ``process``: only what uid 65534 may write);
* is limited in wall time (the supervisor kills every descendant at the deadline; the caller
  kills the whole backend as a backstop), CPU time (``RLIMIT_CPU``), address space
  (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``, stdout/stderr included), no core dumps;
* has no network (network namespace, or the audit hook where none is available);
* sees a minimal environment (``PATH``, ``HOME``/``TMPDIR`` = the working dir, ``LANG``).

When the program ends (or the deadline passes) every process it left behind is killed before
:func:`run_python` returns: the PID namespace dies with its init (``bwrap``/``unshare``), or the
subreaper supervisor kills its descendants (``process``).

**Graded test runs** (``tests=``): the supervisor forks a *tests process* (T) first, then the
*solution process* (S). T compiles and runs the tests with its own builtins and never runs a
line of the solution: every solution name is a proxy that asks S over a socket; values cross
as JSON-encoded plain data (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``complex`` and the builtin containers, exact types only), decoded by T into builtin types;
modules and functions of an allowlist of pure standard-library modules are T's own; any other
object stays in S behind an opaque handle (call, attribute, iteration, ``len``, index;
identity equality -- its ``__eq__`` is never consulted). T is non-dumpable and, where the
caller is root, runs as :data:`TESTS_UID` (65533), not the program's uid: S cannot signal it,
open its ``/proc/<pid>/fd`` or read its memory. Only T holds the token pipe (a per-run
``secrets.token_hex(16)``) and the result pipe; the supervisor closes its copies before S
exists, and makes itself non-dumpable. After the tests' last statement returned, T writes the
token; the caller checks it (:attr:`SandboxResult.tests_completed`). The exit status, signals
or stderr of the solution are never a signal of anything but themselves
(:attr:`SandboxResult.timed_out` is the only supervisor-attested limit). What remains for a
hostile solution -- hard-coding answers from the arguments it sees, turning its run into a
timeout, and more where the caller is not root -- is listed in ``docs/plugins/sandbox.md``.

Not isolated anywhere: CPU cores and memory bandwidth (no cgroup), reading world-readable
files, kernel attack surface (no seccomp filter). ``process`` as root where the interpreter is
not readable by uid 65534 runs the program as root (no uid drop; see ``describe()``); as root,
``process`` runs only with ``MOLT_SANDBOX_PROCESS_AS_ROOT=1`` (else ``PermissionError``). A run on
``unshare`` or ``process`` logs once (``molt.sandbox``, per process) what it does not isolate (:data:`GAPS`).
Labs can plug in a remote sandbox service with the ``molt_register_sandbox_backends`` hook.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "SandboxResult", "SandboxRequest", "SandboxBackend", "LocalBackend", "run_python", "network_isolation",
    "MEMORY_EXIT_CODE", "SANDBOX_UID", "TESTS_UID", "RETURN_MARGIN_S", "sandbox_backend", "available_backends", "get_backend", "BACKEND_ENV",
    "ALLOW_ROOT_PROCESS_ENV", "GAPS",
]

#: Exit code the child uses when the user's code dies of ``MemoryError``.
MEMORY_EXIT_CODE = 86
#: uid and gid the program runs as when the caller is root (``nobody``).
SANDBOX_UID = 65534
#: uid and gid of the tests process of a graded run when the caller is root (not the program's:
#: the program cannot signal it).
TESTS_UID = 65533
#: :func:`run_python` returns within ``timeout_s + RETURN_MARGIN_S`` seconds: the backstop kill
#: comes 10 s after the deadline, plus start-up and clean-up. A caller bounding a sandboxed
#: run (``code_tests``'s runtime bound) allows this margin, so it never cuts a run the sandbox
#: would still have judged.
RETURN_MARGIN_S = 15.0
_BACKSTOP_S = 10.0
#: Environment variable naming the backend (``bwrap``, ``unshare``, ``process`` or a plugin's).
BACKEND_ENV = "MOLT_SANDBOX_BACKEND"
#: Set to ``1`` to let the ``process`` backend run model code when the caller is root (refused otherwise).
ALLOW_ROOT_PROCESS_ENV = "MOLT_SANDBOX_PROCESS_AS_ROOT"
#: What the backends weaker than ``bwrap`` do not isolate (logged once per process and backend).
GAPS = {"unshare": "no IPC or UTS namespace (SysV/POSIX IPC shared with the host), the host's /dev and /dev/shm "
                   "(read-only)",
        "process": "no PID namespace (the program sees every host process), no mount namespace (it writes wherever "
                   "its uid may: /tmp, /dev/shm; anywhere when it runs as root)"}

Status = Literal["ok", "error", "timeout", "memory", "output_limit"]
Isolation = Literal["auto", "namespace", "audit"]

# The supervisor: argv[1] is a JSON config (no secrets in it). It runs as the backend's root
# (or the caller's uid), forks the program, and kills every descendant when the program ends
# or the deadline passes. Kept free of imports a user could shadow (it runs before user code).
_SUPERVISOR = r'''
import json, os, signal, sys, time
C = json.loads(sys.argv[1])
C["deadline"] = time.monotonic() + C["timeout"]  # the program's wall time starts with the supervisor


def _libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


def _harden_mounts(m):
    import ctypes
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: s.encode() if s is not None else None
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "mount %s on %s: %s" % (src, dst, os.strerror(e)))

    def setattr_(path, set_, clr, flags):
        attr = (ctypes.c_uint64 * 4)(set_, clr, 0, 0)
        r = libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), path.encode(), ctypes.c_uint(flags),
                         ctypes.byref(attr), ctypes.c_size_t(32))  # mount_setattr (Linux >= 5.12)
        if r != 0:
            e = ctypes.get_errno()
            raise OSError(e, "mount_setattr %s: %s" % (path, os.strerror(e)))

    MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
    os.umask(0o022)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for hide, keep in m["hide"]:
        fds = [os.open(p, os.O_PATH) for p in keep]
        mount("tmpfs", hide, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        for p, fd in zip(keep, fds):
            os.makedirs(p, mode=0o755, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            os.close(fd)
    mount(m["work"], m["work"], None, MS_BIND | MS_REC)
    setattr_("/", 1, 0, 0x8000)       # MOUNT_ATTR_RDONLY, AT_RECURSIVE: every mount read-only
    setattr_(m["work"], 0, 1, 0)      # ... but the working dir
    os.chdir(m["work"])               # the cwd still pointed at the dir under the bind mount


def _limits(uid, nproc):
    """Resource limits, no_new_privs, the uid drop and the network block of a forked child."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if C["cpu"] > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (C["cpu"], C["cpu"]))
    if C["fsize"] > 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (C["fsize"], C["fsize"]))
    if nproc > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _libc().prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary regains privileges
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if C["block_net"]:
        _NET = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
                "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "socket.socketpair"}

        def _no_net(event, args):
            if event in _NET:
                raise PermissionError("network access is disabled in the molt sandbox (" + event + ")")
        sys.addaudithook(_no_net)


def _user_traceback(t, v, tb, _orig=sys.excepthook):
    # drop the harness's own frames: the traceback starts at the program's first frame
    user = tb
    while user is not None and user.tb_frame.f_code.co_filename not in ("main.py", "tests.py"):
        user = user.tb_next
    if user is None and isinstance(v, SyntaxError):  # the program did not compile: no frame of it
        v, tb = v.with_traceback(None), None
    elif user is not None and isinstance(v, BaseException):
        v, tb = v.with_traceback(user), user
    _orig(t, v, tb)


def _child():
    """The program alone (no tests): ``main.py`` as ``__main__``."""
    os.close(C["status_fd"])
    _limits(C["uid"], C["nproc"])
    import resource
    if C["mem"] > 0:
        resource.setrlimit(resource.RLIMIT_AS, (C["mem"], C["mem"]))
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    sys.excepthook = _user_traceback
    try:
        import runpy
        runpy.run_path("main.py", run_name="__main__")
    except MemoryError:
        try:
            sys.stderr.write("MemoryError: the program exceeded its memory limit\n")
            sys.stderr.flush()
        finally:
            os._exit(C["memory_exit"])


# -- graded test runs: the solution (S) and the tests (T) in two processes ----------------
# T runs the task's tests and never runs a line of the solution: every solution name the
# tests use is a proxy that asks S over a socket. Values cross as plain data (JSON with tags
# for the builtin containers), decoded by T into builtin types only; any other object stays
# in S behind an opaque handle (call, attribute, iteration, len, index; identity equality).

def _send(fd, obj):
    import json
    data = json.dumps(obj).encode()
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def _recv(fd, limit=1 << 28):
    import json

    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("the solution process closed the connection")
            buf += chunk
        return buf
    n = int.from_bytes(exact(8), "little")
    if n > limit:
        raise ValueError("the solution process sent %d bytes" % n)
    return json.loads(exact(n))


def _solution(fd):
    """S: run ``main.py`` as ``__main__``, then serve the tests' requests until they end."""
    for f in (C["status_fd"],):
        os.close(f)
    _limits(C["uid"], C["nproc"])
    import builtins, json, resource, types  # noqa: F401 -- json before the solution can shadow it
    if C["mem"] > 0:
        resource.setrlimit(resource.RLIMIT_AS, (C["mem"], C["mem"]))
    sys.argv = ["main.py"]
    sys.path.insert(0, os.getcwd())
    sys.excepthook = _user_traceback
    table = {}
    plain = (type(None), bool, int, float, str)

    def enc(v):
        t = type(v)
        if t is int and not -(1 << 62) < v < (1 << 62):
            return ["i", hex(v)]  # hex: no int_max_str_digits limit, any size
        if t in plain:
            return v
        if t is list:
            return ["l", [enc(x) for x in v]]
        if t is tuple:
            return ["t", [enc(x) for x in v]]
        if t is dict:
            return ["d", [[enc(k), enc(x)] for k, x in v.items()]]
        if t is set:
            return ["s", [enc(x) for x in v]]
        if t is frozenset:
            return ["f", [enc(x) for x in v]]
        if t is bytes:
            return ["b", v.hex()]
        if t is complex:
            return ["c", v.real, v.imag]
        table[id(v)] = v
        if t is types.ModuleType:
            return ["m", v.__name__, id(v)]
        mod, qual = getattr(v, "__module__", None), getattr(v, "__qualname__", None)
        if isinstance(mod, str) and isinstance(qual, str) and mod not in ("__main__", "builtins"):
            return ["r", mod, qual, id(v), t.__name__]
        return ["h", id(v), t.__name__]

    def dec(x):
        if not isinstance(x, list):
            return x
        tag = x[0]
        if tag == "h":
            return table[x[1]]
        if tag == "i":
            return int(x[1], 16)
        vals = [dec(y) for y in x[1]] if tag != "d" else None
        if tag == "l":
            return vals
        if tag == "t":
            return tuple(vals)
        if tag == "s":
            return set(vals)
        if tag == "f":
            return frozenset(vals)
        if tag == "d":
            return {dec(k): dec(v) for k, v in x[1]}
        if tag == "b":
            return bytes.fromhex(x[1])
        if tag == "c":
            return complex(x[1], x[2])
        if tag == "r":
            import importlib
            obj = importlib.import_module(x[1])
            for part in x[2].split("."):
                obj = getattr(obj, part)
            return obj
        raise ValueError("bad tag %r" % (tag,))

    mod = types.ModuleType("__main__")
    mod.__file__ = os.path.join(os.getcwd(), "main.py")
    sys.modules["__main__"] = mod
    try:
        with open("main.py", "rb") as f:
            code = compile(f.read(), "main.py", "exec")
        exec(code, mod.__dict__)
        names = {k: enc(v) for k, v in list(mod.__dict__.items()) if not k.startswith("__")}
    except MemoryError:
        sys.stderr.write("MemoryError: the program exceeded its memory limit\n")
        sys.stderr.flush()
        os._exit(C["memory_exit"])
    except SystemExit as e:  # the solution ended itself before the tests: keep its status
        code = e.code
        if code is not None and not isinstance(code, int):
            sys.stderr.write(str(code) + "\n")
            code = 1
        for s_ in (sys.stdout, sys.stderr):
            try:
                s_.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit((code or 0) & 0xFF)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)
    _send(fd, ["ok", names])
    while True:
        try:
            req = _recv(fd)
        except (EOFError, OSError):
            break
        try:
            op, obj = req[0], table[req[1]]
            if op == "call":
                out = obj(*[dec(a) for a in req[2]], **{k: dec(v) for k, v in req[3]})
            elif op == "getattr":
                out = getattr(obj, req[2])
            elif op == "iter":
                out = iter(obj)
            elif op == "next":
                try:
                    out = next(obj)
                except StopIteration:
                    _send(fd, ["stop"])
                    continue
            elif op == "len":
                out = len(obj)
            elif op == "getitem":
                out = obj[dec(req[2])]
            else:
                raise ValueError("unknown request %r" % (op,))
            reply = ["ok", enc(out)]
        except BaseException as e:  # noqa: BLE001 -- the tests see it as an exception of the call
            reply = ["err", type(e).__name__, str(e)[:2000]]
        try:
            _send(fd, reply)
        except (TypeError, ValueError, RecursionError) as e:  # not JSON-able (a NaN key...): an error
            _send(fd, ["err", type(e).__name__, str(e)[:2000]])
    for s_ in (sys.stdout, sys.stderr):
        try:
            s_.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(0)


def _tests(fd):
    """T: run the tests against proxies of the solution's names; only after their last
    statement returned, read the run's token and hand it back."""
    _libc().prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no /proc/<pid>/fd, mem or ptrace of T
    os.close(C["status_fd"])
    with os.fdopen(C["tests_fd"], "rb") as f:
        tests = f.read().decode("utf-8")
    _limits(C["tests_uid"], 0)
    _libc().prctl(4, 0, 0, 0, 0)
    import builtins, importlib, resource
    if C["mem"] > 0:
        resource.setrlimit(resource.RLIMIT_AS, (C["mem"], C["mem"]))
    sys.excepthook = _user_traceback
    # standard-library modules whose objects the tests may take locally (a solution's
    # ``import math`` / ``from math import sqrt`` become T's own, unpatched math); any other
    # module or object of the solution stays in S behind a handle
    pure = {"math", "cmath", "collections", "collections.abc", "itertools", "functools", "heapq", "bisect", "re",
            "string", "typing", "operator", "fractions", "decimal", "statistics", "random", "copy", "datetime",
            "json", "array", "numbers", "dataclasses", "enum", "textwrap", "unicodedata", "hashlib", "calendar"}
    handles = {}

    class SolutionError(Exception):
        """An exception raised by the solution that is not a builtin exception type."""

    def rpc(msg):
        _send(fd, msg)
        r = _recv(fd)
        if r[0] == "ok":
            return dec(r[1])
        if r[0] == "stop":
            raise StopIteration
        cls = getattr(builtins, r[1], None) if isinstance(r[1], str) else None
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(r[2])
        raise SolutionError("%s: %s" % (r[1], r[2]))

    class Handle:
        """An object of the solution process: calls, attributes, iteration, len and indexing
        are asked of it; equality is identity (its own ``__eq__`` is never consulted)."""
        __slots__ = ("_id", "_type", "__weakref__")

        def __call__(self, *a, **k):
            return rpc(["call", self._id, [enc(x) for x in a], [[n, enc(v)] for n, v in k.items()]])

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return rpc(["getattr", self._id, name])

        def __iter__(self):
            it = rpc(["iter", self._id])
            while True:
                try:
                    yield rpc(["next", it._id])
                except StopIteration:
                    return

        def __len__(self):
            n = rpc(["len", self._id])
            if type(n) is not int:
                raise TypeError("len() of a solution object gave %r" % (n,))
            return n

        def __getitem__(self, key):
            return rpc(["getitem", self._id, enc(key)])

        def __repr__(self):
            return "<solution %s object>" % (self._type,)

    def handle(i, tname):
        h = handles.get(i)
        if h is None:
            h = handles[i] = Handle()
            h._id, h._type = i, str(tname)[:100]
        return h

    def local(modname, qual):
        if not isinstance(modname, str) or modname not in pure:
            return None
        try:
            obj = importlib.import_module(modname)
            for part in qual.split(".") if qual is not None else ():
                obj = getattr(obj, part)
            return obj
        except Exception:  # noqa: BLE001
            return None

    def dec(x):
        t = type(x)
        if t is not list:
            if t in (type(None), bool, int, float, str):
                return x
            raise ValueError("bad value from the solution process")
        tag = x[0]
        if tag == "i":
            if type(x[1]) is not str:
                raise ValueError("bad value from the solution process")
            return int(x[1], 16)
        if tag == "l":
            return [dec(y) for y in x[1]]
        if tag == "t":
            return tuple(dec(y) for y in x[1])
        if tag == "s":
            return set(dec(y) for y in x[1])
        if tag == "f":
            return frozenset(dec(y) for y in x[1])
        if tag == "d":
            return {dec(k): dec(v) for k, v in x[1]}
        if tag == "b":
            return bytes.fromhex(x[1])
        if tag == "c":
            return complex(float(x[1]), float(x[2]))
        if tag == "h":
            return handle(int(x[1]), x[2])
        if tag == "r":
            obj = local(x[1], x[2])
            return obj if obj is not None else handle(int(x[3]), x[4])
        if tag == "m":
            obj = local(x[1], None)
            return obj if obj is not None else handle(int(x[2]), "module")
        raise ValueError("bad value from the solution process")

    def enc(v):
        t = type(v)
        if t is int and not -(1 << 62) < v < (1 << 62):
            return ["i", hex(v)]
        if t in (type(None), bool, int, float, str):
            return v
        if t is list:
            return ["l", [enc(x) for x in v]]
        if t is tuple:
            return ["t", [enc(x) for x in v]]
        if t is dict:
            return ["d", [[enc(k), enc(x)] for k, x in v.items()]]
        if t is set:
            return ["s", [enc(x) for x in v]]
        if t is frozenset:
            return ["f", [enc(x) for x in v]]
        if t is bytes:
            return ["b", v.hex()]
        if t is complex:
            return ["c", v.real, v.imag]
        if t is Handle:
            return ["h", v._id]
        mod, qual = getattr(v, "__module__", None), getattr(v, "__qualname__", None)
        if isinstance(mod, str) and isinstance(qual, str) and (
                local(mod, qual) is v or (mod == "builtins" and getattr(builtins, qual, None) is v)):
            return ["r", mod, qual]  # a standard-library function or class: the solution imports it
        raise TypeError("cannot pass %s to the solution (plain data and the solution's own objects only)" % t.__name__)

    try:
        code = compile(tests, "tests.py", "exec")
        first = _recv(fd)
        if first[0] != "ok" or type(first[1]) is not dict:
            raise RuntimeError("the solution process sent no names")
        g = {}
        for k, v in first[1].items():
            if type(k) is str and not k.startswith("__") and (k not in builtins.__dict__ or k in C["keep_names"]):
                try:
                    g[k] = dec(v)
                except Exception:  # noqa: BLE001 -- a name the tests cannot use; they fail if they do
                    pass
        g.update(__name__="__main__", __builtins__=builtins)
        exec(code, g)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        os._exit(1)
    # every test statement ran to completion: only now fetch the token and hand it back
    token = os.read(C["tok_fd"], 256)
    for s_ in (sys.stdout, sys.stderr):
        try:
            s_.flush()
        except Exception:  # noqa: BLE001
            pass
    os.write(C["done_fd"], token)
    os._exit(0)


def _descendants():
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d, "rb") as f:
                    s = f.read()
                kids.setdefault(int(s[s.rindex(b")") + 2:].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [os.getpid()]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _supervise(main, prog):
    """Wait for ``main`` (the tests process, or the program without tests) until the deadline,
    give the program a moment to end, kill every descendant, report what *this* process saw:
    whether the deadline passed, the program's exit status and the CPU seconds it used."""
    st = {}

    def reap():
        while True:
            try:
                r, s, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if r == 0:
                return
            st[r] = (s, ru.ru_utime + ru.ru_stime)

    timed_out = False
    while main not in st:
        left = C["deadline"] - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        signal.sigtimedwait([signal.SIGCHLD], min(left, 0.25))
        reap()
    grace = min(C["deadline"], time.monotonic() + 0.5)
    while prog not in st and not timed_out and time.monotonic() < grace:  # S ends at the tests' EOF
        signal.sigtimedwait([signal.SIGCHLD], 0.02)
        reap()
    for _ in range(10000):  # kill every descendant (orphans are re-parented to us)
        ds = _descendants()
        if not ds:
            break
        for d in ds:
            try:
                os.kill(d, signal.SIGKILL)
            except OSError:
                pass
        reap()
        time.sleep(0.001)
    reap()
    out = {"timeout": timed_out, "exit": None, "signal": None, "cpu": None}
    if prog in st:
        s, cpu = st[prog]
        out["cpu"] = cpu
        if os.WIFSIGNALED(s):
            out["signal"] = os.WTERMSIG(s)
        else:
            out["exit"] = os.WEXITSTATUS(s)
    os.write(C["status_fd"], json.dumps(out).encode())
    os._exit(0)


if C["mounts"]:
    _harden_mounts(C["mounts"])
_libc().prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0: the program cannot open our fds via /proc or ptrace us
_libc().prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans (setsid grandchildren) come to us
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
os.write(C["status_fd"], b"S")  # started: from here on, a missing verdict is the program's doing
if C["tests_fd"] < 0:
    _pid = os.fork()
    if _pid == 0:
        _child()
        sys.exit(0)  # a normal interpreter exit (atexit handlers, buffered output flushed)
    _supervise(_pid, _pid)
import socket
_s_sock, _t_sock = socket.socketpair()
_tpid = os.fork()  # T first: the supervisor drops the token before the solution exists
if _tpid == 0:
    _s_sock.close()
    _tests(_t_sock.fileno())
for _fd in (C["tok_fd"], C["done_fd"], C["tests_fd"]):
    os.close(_fd)
_t_sock.close()
_spid = os.fork()
if _spid == 0:
    _solution(_s_sock.fileno())
_s_sock.close()
_supervise(_tpid, _spid)
'''


@dataclass
class SandboxResult:
    """Outcome of :func:`run_python`.

    * ``status`` -- ``ok`` (exit 0), ``error`` (non-zero exit or a signal), ``timeout``
      (= ``timed_out``), ``memory`` (``MemoryError`` under the ``RLIMIT_AS`` cap),
      ``output_limit`` (a written file passed ``max_output_bytes``). Only ``timeout`` is
      attested by the supervisor; ``memory`` and ``output_limit`` are read from what the
      program did or printed (its exit code, its stderr, its signals), so a program can fake
      them: they describe, they never grade (:func:`molt_plugins.rewards.code.grade_tests`
      reads only ``tests_completed`` and ``timed_out``).
    * ``timed_out`` -- True only when the supervisor (or the caller's backstop) saw the wall
      deadline pass with the program (graded run: the tests) still running, or measured the
      program's CPU time at the ``RLIMIT_CPU`` limit (``int(timeout_s) + 2`` s) when it died.
      A program cannot make it True by itself except by actually running that long.
    * ``cpu_s`` -- CPU seconds (user + system) the program used, measured by the supervisor
      (None where unknown).
    * ``returncode`` -- the program's exit status (negative: killed by that signal; None when
      unknown). In a graded run, the solution process's.
    * ``stdout`` / ``stderr`` -- decoded UTF-8 (errors replaced), each at most
      ``max_output_bytes``.
    * ``duration_s`` -- wall seconds from start to reap.
    * ``isolation`` -- how the network was cut: ``namespace``, ``audit``, or ``none``.
    * ``tests_completed`` -- with ``tests=``: True only when the harness returned the run's
      token after the tests' last statement (the only pass signal); None without tests.
    * ``backend`` -- the backend that ran it (``bwrap``, ``unshare``, ``process``, a plugin's).
    * ``uid`` -- the uid the program ran as, where known (None: unknown, e.g. remote).
    """

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: str
    tests_completed: bool | None = None
    backend: str = "process"
    uid: int | None = None
    timed_out: bool = False
    cpu_s: float | None = None

    @property
    def ok(self) -> bool:
        """True when the program exited 0 (not a grading signal: see ``tests_completed``)."""
        return self.status == "ok"

    def reason(self) -> str:
        """A one-line explanation: status, exit code, last stderr line."""
        last = next((ln for ln in reversed(self.stderr.strip().splitlines()) if ln.strip()), "")
        return f"{self.status} (exit {self.returncode}, {self.duration_s:.2f}s){': ' + last[:300] if last else ''}"


@dataclass(frozen=True)
class SandboxRequest:
    """One run, as handed to a :class:`SandboxBackend` (see :func:`run_python` for each field)."""

    code: str
    tests: str | None = None
    keep_names: tuple[str, ...] = ()
    timeout_s: float = 5.0
    memory_mb: int | None = 1024
    network: bool = False
    isolation: Isolation = "auto"
    files: dict[str, str] = field(default_factory=dict)
    stdin: str | None = None
    max_output_bytes: int = 1_000_000
    max_processes: int = 64
    python: str | None = None


@runtime_checkable
class SandboxBackend(Protocol):
    """What a sandbox backend provides (register one with ``molt_register_sandbox_backends``).

    ``run`` must honour every limit of the request and, for ``request.tests``, report
    ``tests_completed=True`` only on a positive signal that every test statement ran (a remote
    service can run :func:`run_python` itself with its local backend).
    """

    name: str

    def available(self) -> bool:
        """True when this backend can run here."""

    def describe(self) -> str:
        """One line: what the backend isolates on this machine."""

    def run(self, request: SandboxRequest) -> SandboxResult:
        """Run ``request``; raise ``OSError`` when the sandbox cannot start."""


# -- helpers ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def network_isolation() -> tuple[str, tuple[str, ...]]:
    """How the ``process`` backend cuts the network: ``("namespace", prefix_argv)`` when
    ``unshare -n`` (or ``unshare -rn``) works, else ``("audit", ())``. Probed once."""
    exe = shutil.which("unshare")
    if exe:
        for flags in (("-n",), ("-r", "-n")):
            if _probe([exe, *flags, "true"]):
                return "namespace", (exe, *flags)
    return "audit", ()


def _probe(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _others_can_enter(path: str) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def _interpreter_paths(python: str | None) -> list[str]:
    """Directories the interpreter needs (prefixes, sys.path dirs), resolved, deduplicated."""
    if python is None:
        cands = [sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                 os.path.dirname(os.path.realpath(sys.executable))]
        cands += [p for p in sys.path if p and os.path.isdir(p)]
    else:
        cands = [os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    out: list[str] = []
    for c in cands:
        r = os.path.realpath(c)
        if r not in out:
            out.append(r)
    return out


def _hidden_ancestor(path: str) -> str | None:
    """The highest proper ancestor of ``path`` that others cannot enter (mode lacks o+x)."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        anc = str(Path(*parts[:i]))
        if not _others_can_enter(anc):
            return anc
    return None


def _reachable_for_others(paths: list[str]) -> bool:
    return all(_hidden_ancestor(p) is None and _others_can_enter(p) for p in paths)


def _hide_plan(paths: list[str]) -> list[tuple[str, list[str]]]:
    """``[(ancestor, [paths under it])]``: ancestors to cover with a 0755 tmpfs, and the
    interpreter paths to bind back inside it (outermost paths only)."""
    plan: dict[str, list[str]] = {}
    for p in sorted(paths, key=len):
        a = _hidden_ancestor(p)
        if a is None:
            continue
        kept = plan.setdefault(a, [])
        if not any(p == k or p.startswith(k + os.sep) for k in kept):
            kept.append(p)
    return list(plan.items())


def _count_uid_processes(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.chown(dirpath, uid, uid)
        for f in filenames:
            os.chown(os.path.join(dirpath, f), uid, uid)


# -- local backends -----------------------------------------------------------------------
class LocalBackend:
    """A backend running on this machine: ``bwrap``, ``unshare`` or ``process`` (see the module
    docstring). Stateless apart from cached availability probes.

    Raises:
        ValueError: unknown ``kind``.
    """

    KINDS = ("bwrap", "unshare", "process")

    def __init__(self, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown local sandbox backend {kind!r}; choose one of {self.KINDS}")
        self.name = kind

    def available(self) -> bool:
        """``bwrap``: ``bwrap`` on PATH and a PID-namespace probe runs; ``unshare``: ``unshare
        --pid --fork --mount --mount-proc`` (``-r`` when not root) runs; then a program runs
        through the backend end to end (probed once per process). ``process``: always."""
        return _available(self.name)

    def program_uid(self, python: str | None = None) -> int:
        """The uid the program runs as under this backend here: ``SANDBOX_UID`` (65534) when
        the caller is root and can drop to it, else the caller's own uid."""
        return SANDBOX_UID if self._drops_uid(python) else os.geteuid()

    def _drops_uid(self, python: str | None) -> bool:
        if os.geteuid() != 0:
            return False
        if self.name in ("bwrap", "unshare"):
            return True
        return _reachable_for_others(_interpreter_paths(python))

    def describe(self) -> str:
        """One line: ``[active]`` / ``[available]`` / ``[unavailable here]``, then the
        namespaces, uid, network cut and write confinement of this backend here."""
        if not self.available():
            return "[unavailable here]"
        try:
            active = sandbox_backend().name == self.name
        except (KeyError, RuntimeError):
            active = False
        return ("[active] " if active else "[available] ") + self._what()

    def _what(self) -> str:
        uid = f"uid {SANDBOX_UID}" if self._drops_uid(None) else f"uid {os.geteuid()} (no drop: " + (
            "caller is not root)" if os.geteuid() != 0 else "interpreter unreachable for uid 65534)")
        if self.name == "bwrap":
            return f"bubblewrap {_bwrap_version()}: PID/IPC/UTS/net namespaces, read-only filesystem but the work dir, {uid}"
        if self.name == "unshare":
            return f"util-linux unshare: PID/mount/net namespaces, read-only mounts but the work dir, {uid}"
        net = "net namespace" if network_isolation()[0] == "namespace" else "audit-hook network block"
        return f"no PID namespace (subreaper supervisor kills descendants), {net}, {uid}"

    def _prefix(self, netns: bool, work: str, drop: bool, python: str | None) -> tuple[list[str], dict | None]:
        if self.name == "bwrap":
            argv = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--unshare-pid",
                    "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
            if netns:
                argv.append("--unshare-net")
            argv += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
            for anc, keep in _hide_plan(_interpreter_paths(python)):
                argv += ["--perms", "0755", "--tmpfs", anc]
                for p in keep:
                    rel = Path(p).relative_to(anc).parts
                    for i in range(1, len(rel)):
                        argv += ["--perms", "0755", "--dir", str(Path(anc, *rel[:i]))]
                    argv += ["--ro-bind", p, p]
            argv += ["--bind", work, work, "--chdir", work]
            if drop:
                argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            return argv + ["--"], None
        if self.name == "unshare":
            argv = [shutil.which("unshare") or "unshare", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
            if netns:
                argv.append("--net")
            if os.geteuid() != 0:
                argv.append("--map-root-user")
            mounts = {"work": work, "hide": _hide_plan(_interpreter_paths(python)) if drop else []}
            return argv + ["--"], mounts
        return list(network_isolation()[1]) if netns else [], None

    def run(self, req: SandboxRequest) -> SandboxResult:
        """Run ``req`` (see :func:`run_python`).

        Raises:
            ValueError: a ``files`` path escaping the working dir; ``isolation="namespace"``
                where no network namespace is available.
            PermissionError: ``process`` as root without ``MOLT_SANDBOX_PROCESS_AS_ROOT=1``.
            OSError: the sandbox could not be started, or its supervisor gave no verdict.
        """
        if req.network:
            netns, iso = False, "none"
        elif req.isolation == "audit":
            netns, iso = False, "audit"
        elif self.name in ("bwrap", "unshare") or network_isolation()[0] == "namespace":
            netns, iso = True, "namespace"
        else:
            netns, iso = False, "audit"
        if req.isolation == "namespace" and not req.network and not netns:
            raise ValueError("isolation='namespace' requested but no network namespace works here "
                             "(`unshare -n`); use 'auto' or 'audit'")
        drop = self._drops_uid(req.python)
        if self.name == "process" and os.geteuid() == 0 and os.environ.get(ALLOW_ROOT_PROCESS_ENV) != "1":
            raise PermissionError(
                f"sandbox backend 'process' as root: neither bubblewrap nor unshare works here, so model code would "
                f"run with {GAPS['process']}, as " + (f"uid {SANDBOX_UID}" if drop else "root (the interpreter is not "
                f"readable for uid {SANDBOX_UID})") + "; install bubblewrap (apt-get install bubblewrap), run as a "
                f"non-root user, or accept it with {ALLOW_ROOT_PROCESS_ENV}=1")
        work = Path(tempfile.mkdtemp(prefix="molt-sbx-"))
        io_dir = Path(tempfile.mkdtemp(prefix="molt-sbx-io-"))
        fds: list[int] = []
        try:
            (work / "main.py").write_text(req.code)
            for rel, text in (req.files or {}).items():
                dest = (work / rel).resolve()
                if work.resolve() not in dest.parents:
                    raise ValueError(f"files: path {rel!r} escapes the sandbox working dir")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text)
            if drop:
                _chown_tree(work, SANDBOX_UID)
            uid = SANDBOX_UID if drop else os.geteuid()
            nproc = _count_uid_processes(uid) + req.max_processes if (drop or os.geteuid() != 0) else 0
            token = secrets.token_hex(16)
            status_r, status_w = os.pipe()
            done_r, done_w = os.pipe()
            tok_r, tok_w = os.pipe()
            fds += [status_r, status_w, done_r, done_w, tok_r, tok_w]
            os.write(tok_w, token.encode())
            os.close(tok_w)
            fds.remove(tok_w)
            tests_fd = -1
            if req.tests is not None:
                tp = io_dir / "tests.py"
                tp.write_text(req.tests)
                tests_fd = os.open(tp, os.O_RDONLY)
                fds.append(tests_fd)
            prefix, mounts = self._prefix(netns, str(work), drop, req.python)
            t0 = time.monotonic()
            cfg = {
                "mem": int(req.memory_mb) * 1024 * 1024 if req.memory_mb else 0, "cpu": int(req.timeout_s) + 2,
                "fsize": req.max_output_bytes, "nproc": nproc, "block_net": iso == "audit",
                "uid": SANDBOX_UID if drop else None, "tests_uid": TESTS_UID if drop else None,
                "timeout": req.timeout_s, "status_fd": status_w,
                "tok_fd": tok_r, "done_fd": done_w, "tests_fd": tests_fd, "keep_names": list(req.keep_names),
                "memory_exit": MEMORY_EXIT_CODE, "mounts": mounts,
            }
            argv = [*prefix, req.python or sys.executable, "-I", "-c", _SUPERVISOR, json.dumps(cfg)]
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "TMPDIR": str(work),
                   "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            out_p, err_p = io_dir / "stdout", io_dir / "stderr"
            backstop = req.timeout_s + _BACKSTOP_S  # the supervisor kills at its deadline; this is a backstop
            with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
                p = subprocess.Popen(
                    argv, cwd=work, env=env, stdout=out_f, stderr=err_f,
                    stdin=subprocess.PIPE if req.stdin is not None else subprocess.DEVNULL,
                    start_new_session=True, close_fds=True,
                    pass_fds=tuple(f for f in (status_w, done_w, tok_r, tests_fd) if f >= 0),
                )
                for f in (status_w, done_w, tok_r, tests_fd):
                    if f >= 0:
                        os.close(f)
                        fds.remove(f)
                hard_timeout = False
                try:
                    if req.stdin is not None:
                        try:
                            p.communicate(req.stdin.encode(), timeout=backstop)
                        except BrokenPipeError:
                            p.wait(timeout=max(0.0, backstop - (time.monotonic() - t0)))
                    else:
                        p.wait(timeout=backstop)
                except subprocess.TimeoutExpired:
                    hard_timeout = True
                finally:
                    _kill_group(p)
                    p.wait()
            dur = time.monotonic() - t0
            sup = _read_fd(status_r, 4096)
            done = _read_fd(done_r, 256)
            return _result(req, p.returncode, sup, hard_timeout, out_p, err_p, dur, iso,
                           (done == token.encode()) if req.tests is not None else None, self.name,
                           uid)
        finally:
            for f in fds:
                try:
                    os.close(f)
                except OSError:
                    pass
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(io_dir, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _warn_weaker(name: str, what: str) -> None:
    """Log once per process and backend that ``name`` is weaker than ``bwrap`` and what it leaves open."""
    net = "" if name != "process" or "net namespace" in what else "; a network cut by an audit hook only (ctypes bypasses it)"
    logging.getLogger("molt.sandbox").warning(
        "sandbox backend %r (%s) is weaker than bubblewrap: %s%s", name, what, GAPS[name], net)


def _read_fd(fd: int, limit: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.kill()
    except ProcessLookupError:
        pass


def _result(req: SandboxRequest, backend_rc: int | None, sup: bytes, hard_timeout: bool, out_p: Path, err_p: Path,
            dur: float, iso: str, tests_completed: bool | None, backend: str, uid: int | None) -> SandboxResult:
    def _read(path: Path) -> str:
        with open(path, "rb") as f:
            return f.read(req.max_output_bytes).decode("utf-8", errors="replace")

    stdout, stderr = _read(out_p), _read(err_p)
    hit_fsize = any(f.stat().st_size >= req.max_output_bytes for f in (out_p, err_p))
    started, sup = sup[:1] == b"S", sup[1:] if sup[:1] == b"S" else sup
    try:
        s = json.loads(sup.decode()) if sup else None
    except ValueError:
        s = None
    if s is None and not hard_timeout and not started:  # the supervisor could not start: no verdict
        last = stderr.strip().splitlines()[-1:] or [""]
        raise OSError(f"the {backend} sandbox's supervisor did not report (exit {backend_rc}): {last[0][:300]}")
    cpu_limit = int(req.timeout_s) + 2
    cpu = None
    if s is None:  # killed by the backstop, or (same uid only) by the program: no verdict, not a pass
        rc, timed_out = (-signal.SIGKILL, True) if hard_timeout else (None, False)
    else:
        timed_out = bool(s["timeout"]) or hard_timeout
        rc = -int(s["signal"]) if s["signal"] is not None else s["exit"]
        cpu = s.get("cpu")
        if timed_out:
            rc = -signal.SIGKILL
        # CPU limit: only when the supervisor measured the CPU time (a self-sent SIGXCPU is no limit)
        elif rc in (-signal.SIGXCPU, -signal.SIGKILL) and cpu is not None and cpu >= cpu_limit - 0.05:
            timed_out = True
    if timed_out:
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
                         isolation=iso, tests_completed=tests_completed, backend=backend, uid=uid,
                         timed_out=timed_out, cpu_s=cpu)


@functools.lru_cache(maxsize=None)
def _bwrap_version() -> str:
    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True, timeout=10).stdout.split()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "?"


@functools.lru_cache(maxsize=None)
def _available(kind: str) -> bool:
    if kind == "process":
        return True
    if sys.platform != "linux":
        return False
    if kind == "bwrap":
        exe = shutil.which("bwrap")
        quick = bool(exe) and _probe([exe, "--die-with-parent", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/",
                                      "--proc", "/proc", "--dev", "/dev", "true"])
    else:
        exe = shutil.which("unshare")
        root = [] if os.geteuid() == 0 else ["--map-root-user"]
        quick = bool(exe) and _probe([exe, "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--net", *root,
                                      "true"])
    if not quick:
        return False
    try:  # end to end: mounts (mount_setattr needs Linux >= 5.12), uid drop, the supervisor
        r = LocalBackend(kind).run(SandboxRequest(code="print(6 * 7)", timeout_s=20.0, memory_mb=None))
    except (OSError, ValueError):
        return False
    return r.status == "ok" and r.stdout == "42\n"


# -- backend selection --------------------------------------------------------------------
_LOCAL = {k: LocalBackend(k) for k in LocalBackend.KINDS}


@functools.lru_cache(maxsize=1)
def _plugin_backends() -> dict[str, Any]:
    from molt_core.plugins import load_plugins

    host = load_plugins()
    return {n: host.get("sandbox_backends", n) for n in host.names("sandbox_backends")}


def get_backend(name: str) -> SandboxBackend:
    """The backend called ``name``: a local one, or one a plugin registered through
    ``molt_register_sandbox_backends`` (installed ``molt`` entry points are loaded once).

    Raises:
        KeyError: no backend of that name (the message lists the known ones).
        RuntimeError: a local backend that is not available on this machine.
    """
    if name in _LOCAL:
        b = _LOCAL[name]
        if not b.available():
            raise RuntimeError(f"sandbox backend {name!r} is not available here (available: {available_backends()})")
        return b
    plugins = _plugin_backends()
    if name not in plugins:
        raise KeyError(f"no sandbox backend named {name!r}; known: {sorted([*_LOCAL, *plugins])}")
    b = plugins[name]
    return b() if isinstance(b, type) else b


def available_backends() -> list[str]:
    """Local backends that work on this machine, in preference order (``bwrap``, ``unshare``,
    ``process``)."""
    return [k for k in LocalBackend.KINDS if _LOCAL[k].available()]


def sandbox_backend(name: str | None = None) -> SandboxBackend:
    """The active backend: ``name``, else ``$MOLT_SANDBOX_BACKEND``, else the first available
    local one (``bwrap`` > ``unshare`` > ``process``).

    Raises:
        KeyError / RuntimeError: as :func:`get_backend`.
    """
    name = name or os.environ.get(BACKEND_ENV) or None
    if name:
        return get_backend(name)
    return _LOCAL[available_backends()[0]]


def run_python(
    code: str,
    *,
    tests: str | None = None,
    keep_names: tuple[str, ...] | list[str] = (),
    timeout_s: float = 5.0,
    memory_mb: int | None = 1024,
    network: bool = False,
    isolation: Isolation = "auto",
    files: dict[str, str] | None = None,
    stdin: str | None = None,
    max_output_bytes: int = 1_000_000,
    max_processes: int = 64,
    python: str | None = None,
    backend: str | SandboxBackend | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temp dir, isolated and limited (module docstring).

    Args:
        code: the Python program (source text).
        tests: test code to run after ``code`` in its namespace (with builtins restored); the
            run passes only if :attr:`SandboxResult.tests_completed` (token after the last test).
        keep_names: names the tests must see from the solution even where they shadow a
            builtin (e.g. the entry point of a task asking for ``sorted``).
        timeout_s: wall-clock limit in seconds (> 0), counted from the supervisor's start (the
            backend's own start-up, ~0.1 s, is not charged); every process of the run is
            killed at it. A backstop kills the whole backend 10 s later if the supervisor fails.
        memory_mb: address-space cap in MiB (``RLIMIT_AS``); None or 0 disables.
        network: allow network access (default False: cut it).
        isolation: network cut: ``auto`` (namespace where available, else audit hook), or force one.
        files: extra files ``{relative_path: text}`` written into the working dir first.
        stdin: text fed to the program's standard input (default: empty).
        max_output_bytes: cap of stdout, stderr and each written file (``RLIMIT_FSIZE``).
        max_processes: processes + threads the program may add (``RLIMIT_NPROC`` over its uid's
            count at start; applies when it runs as a non-root uid).
        python: interpreter (default ``sys.executable``).
        backend: a backend name or object (default :func:`sandbox_backend`).

    Returns:
        :class:`SandboxResult`.

    Raises:
        ValueError: ``timeout_s <= 0``, a negative memory cap, ``max_processes < 1``, a
            ``files`` path escaping the working dir, or ``isolation="namespace"`` where network
            namespaces are unavailable.
        OSError: the sandbox could not be started, or its supervisor died without a verdict
            (e.g. killed by a program that runs as the same uid under ``process``).
        KeyError / RuntimeError: an unknown or unavailable ``backend``.
        PermissionError: the ``process`` backend as root without ``MOLT_SANDBOX_PROCESS_AS_ROOT=1``.

    Logs (``molt.sandbox``, once per process and backend): what ``unshare`` / ``process`` do not isolate.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb is not None and memory_mb < 0:
        raise ValueError(f"memory_mb must be >= 0 or None, got {memory_mb}")
    if max_processes < 1:
        raise ValueError(f"max_processes must be >= 1, got {max_processes}")
    b = backend if backend is not None and not isinstance(backend, str) else sandbox_backend(backend)
    req = SandboxRequest(code=code, tests=tests, keep_names=tuple(keep_names), timeout_s=timeout_s,
                         memory_mb=memory_mb, network=network, isolation=isolation, files=dict(files or {}),
                         stdin=stdin, max_output_bytes=max_output_bytes, max_processes=max_processes, python=python)
    if isinstance(b, LocalBackend) and b.name in GAPS:  # once per process (not in the availability probes)
        _warn_weaker(b.name, b._what())
    return b.run(req)
