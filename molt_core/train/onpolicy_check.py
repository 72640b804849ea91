"""The on-policy check of stale rows in a process of its own, beside the update.

:class:`CheckProcess` runs :func:`~molt_core.train.version_history.stale_absdiff` in a child
(``python -m molt_core.train.onpolicy_check``) over version copies in a shared-memory ring, so on a
multi-core CPU it costs the update nothing; bit-identical to the in-line check (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Any, Callable

import torch

from molt_core.train.forward import forward_rows, recompute_logprobs
from molt_core.train.version_history import stale_absdiff, storage_key

__all__ = ["CheckProcess"]

_ALIGN = 64  # bytes: every tensor of a slot starts on a cache line (and any dtype's alignment)


def ring_layout(model: torch.nn.Module) -> tuple[dict[str, tuple[int, torch.dtype, tuple[int, ...]]], int]:
    """Where each state-dict entry of ``model`` lives in one slot's flat buffer.

    Returns:
        ``({name: (byte offset, dtype, shape)}, slot bytes)``; entries that share storage (tied
        embeddings) get the same offset; each starts on a 64-byte boundary. Raises nothing.
    """
    layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    at: dict[tuple, int] = {}
    end = 0
    for k, v in model.state_dict().items():
        key = storage_key(v)
        if key not in at:
            at[key] = end
            end += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
        layout[k] = (at[key], v.dtype, tuple(v.shape))
    return layout, max(end, _ALIGN)


def map_slot(path: str, layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]],
             nbytes: int) -> dict[str, torch.Tensor]:
    """The state dict of one ring slot: views into ``path`` mapped shared (created with
    ``nbytes`` bytes when missing), per :func:`ring_layout`.
    Returns name -> CPU tensor (the layout's dtype and shape) whose storage is the mapping.

    Raises:
        RuntimeError: ``path`` cannot be opened or mapped (``torch.from_file``).
    """
    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for k, (off, dtype, shape) in layout.items():
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[k] = buf[off:off + n].view(dtype).view(shape)
    return out


def _shm_dir() -> str | None:
    """``/dev/shm`` where it exists (Linux), else None (the temp dir: a file-backed mapping)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _reserve(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` bytes allocated now (``posix_fallocate`` where the OS has
    it), so a full ``/dev/shm`` is an ``OSError`` here instead of a SIGBUS at a later write.

    Raises:
        OSError: no room (ENOSPC), or the file cannot be created.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # (macOS: no /dev/shm either; a sparse file in the temp dir)
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _shm_free() -> int | None:
    """Free bytes of ``/dev/shm`` (None where there is none, e.g. macOS)."""
    d = _shm_dir()
    if d is None:
        return None
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


class CheckProcess:
    """A child process that runs the on-policy check of stale rows.

    Args:
        model: the policy (pickled once; the child builds one copy per ring slot on its tensors).
        slots: ring slots (``async.max_staleness + 1``).
        micro_batch_size, compute_dtype, threads, shared_prefix: the trainer's micro-batch rows,
            autocast dtype (``torch.float32``: none), ``torch.get_num_threads()`` and
            ``shared_prefix``, so the child's forwards are the in-line check's.

    Attributes:
        ring: ``slots`` state dicts (name -> CPU tensor in shared memory) for
            :meth:`molt_core.train.version_history.VersionHistory.share`.

    Raises:
        MemoryError: the ring would take more than half of the free space of ``/dev/shm``, or
            does not fit in it.
        Exception: whatever pickling the model or starting the process raises (a failure inside
            the child is raised by :meth:`ready`).
    """

    def __init__(self, model: torch.nn.Module, slots: int, micro_batch_size: int, compute_dtype: torch.dtype,
                 threads: int, shared_prefix: bool = False) -> None:
        layout, nbytes = ring_layout(model)
        free = _shm_free()
        if free is not None and slots * nbytes > free // 2:
            raise MemoryError(f"the version history's shared ring needs {slots * nbytes / 2**20:.1f} MiB and "
                              f"/dev/shm has {free / 2**20:.1f} MiB free (half of it may be used; Ray's object "
                              f"store lives there too): give the container a larger /dev/shm (docker run --shm-size)")
        blob = pickle.dumps(model)
        self._tmp = tempfile.mkdtemp(prefix="molt-onpolicy-", dir=_shm_dir())
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        paths = [os.path.join(self._tmp, f"slot{i}") for i in range(slots)]
        try:
            for p in paths:
                _reserve(p, nbytes)
        except OSError as e:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise MemoryError(f"the version history's shared ring ({slots * nbytes / 2**20:.1f} MiB) does not fit "
                              f"in {_shm_dir() or tempfile.gettempdir()} ({e.strerror}): give the container a larger "
                              f"/dev/shm (docker run --shm-size)") from e
        self.ring = [map_slot(p, layout, nbytes) for p in paths]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the trainer's imports
        # Linux: the files are unlinked at once and live on through descriptors the child inherits
        # (/proc/self/fd/N), so nothing is left whoever is killed when; else the child removes them
        fds = [os.open(p, os.O_RDWR) for p in paths] if os.path.isdir("/proc/self/fd") else []
        if fds:
            shutil.rmtree(self._tmp, ignore_errors=True)
            paths = [f"/proc/self/fd/{fd}" for fd in fds]
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "molt_core.train.onpolicy_check", self._tmp],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, pass_fds=fds,
                                          process_group=0)  # a terminal's Ctrl-C is the trainer's alone
        finally:
            for fd in fds:
                os.close(fd)
        # the model (more than a pipe holds) goes on a thread, so the step that starts it goes on
        self._sender = threading.Thread(target=self._send_start, name="molt-onpolicy-start", daemon=True,
                                        args=((blob, paths, layout, nbytes, micro_batch_size, compute_dtype, threads,
                                               shared_prefix),))
        self._finalizer.detach()
        self._sent = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._tmp, self._sender, self._sent)
        self._sender.start()
        self._ready = False
        self._busy = False
        #: checks run in the child so far
        self.checks = 0

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether the child has mapped the ring and built its models (waiting up to ``timeout``
        seconds; the trainer checks in line until then).

        Raises:
            RuntimeError: the child could not start (its error's text, e.g. a model class defined
                in a script's ``__main__``) or died.
        """
        if not self._ready:
            import select

            if not select.select([self._proc.stdout], [], [], timeout)[0]:
                return False
            ok, err = self._recv()
            self._sender.join()  # the child has read the whole start message
            shutil.rmtree(self._tmp, ignore_errors=True)  # (the child removed it already)
            if not ok:
                self.close()
                raise RuntimeError(f"the on-policy check process could not start: {err}")
            self._ready = True
        return True

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def _send_start(self, msg: Any) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # the child is gone (or closed): ready() says so
            self._send(msg)
            self._sent.set()

    def _send(self, obj: Any) -> None:
        try:
            pickle.dump(obj, self._proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._proc.stdin.flush()  # type: ignore[union-attr]
        except OSError as e:  # a broken pipe: the child is gone
            raise RuntimeError(f"the on-policy check process died (exit code {self._proc.poll()})") from e

    def _recv(self) -> Any:
        try:
            return pickle.load(self._proc.stdout)  # type: ignore[arg-type]
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            try:
                code = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # alive, but its reply was cut (an interrupted read): stop it
                self._proc.kill()
                code = self._proc.wait()
            raise RuntimeError(f"the on-policy check process died (exit code {code})") from e

    def submit(self, batch: Any, version: int, slots: dict[int, int], max_rows: int,
               seed: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start the check of ``batch`` (a :class:`~molt_core.train.ingress.Batch` without images or
        routing) at trainer ``version``; ``slots``: held older version -> ring slot; ``max_rows``,
        ``seed``: :func:`stale_absdiff`'s sample. Returns a function that waits for its ``(diffs,
        rows)`` (``[N]`` float64, ``[N]`` long). The ring slots read must not be written before the
        result is taken (the ring's spare slot guarantees it for one check in flight). A check whose result was never taken is waited for here and its reply dropped.

        Raises:
            RuntimeError: the child is dead (here), or it failed (its error's text) or died
                during the check (from the returned function).
        """
        if not self._ready:
            raise RuntimeError("internal: an on-policy check was submitted before the process was ready")
        if self._busy:  # an interrupted step's check: its reply is dropped (it failed or not)
            with contextlib.suppress(_CheckFailed):
                self._take()
        self._send((batch, version, slots, max_rows, seed))
        self._busy = True
        self.checks += 1
        return self._take

    def _take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The reply of the check in flight (``_busy`` stays set until it is read whole)."""
        ok, out = self._recv()
        self._busy = False
        if not ok:
            raise _CheckFailed(f"the on-policy check process failed: {out}")
        return out

    def close(self) -> None:
        """Stop the child (it exits when its stdin closes; killed after 5 s)."""
        self._finalizer()


class _CheckFailed(RuntimeError):
    """A check failed in the child (its error's text); the child goes on."""


def _stop(proc: subprocess.Popen, tmp: str, sender: threading.Thread, sent: threading.Event) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if not sent.is_set():  # the child has not read its start message (still importing, or stuck): no
        proc.kill()  # check can be in flight; closing stdin would wait for the sender's write, which fails now
        if sender is not threading.current_thread():
            sender.join()
    with contextlib.suppress(OSError):
        proc.stdin.close()  # type: ignore[union-attr]
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError):
        proc.stdout.close()  # type: ignore[union-attr]


class _Forwarder:
    """What ``recompute_logprobs`` reads of a one-process CPU trainer: micro-batches, autocast, ``shared_prefix``."""

    device = torch.device("cpu")
    lockstep = False
    vision_processor = None

    def __init__(self, micro_batch_size: int, compute_dtype: torch.dtype, shared_prefix: bool = False) -> None:
        self.micro_batch_size = micro_batch_size
        self.compute_dtype = compute_dtype
        self.shared_prefix = shared_prefix

    def _work(self, batch: Any, model: Any = None) -> list[tuple[slice, bool]]:
        mb = self.micro_batch_size
        return [(slice(i, min(i + mb, batch.size)), True) for i in range(0, batch.size, mb)]

    def _combine_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _routing(self, *_: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def autocast(self) -> Any:
        enabled = self.compute_dtype != torch.float32
        return torch.autocast("cpu", dtype=self.compute_dtype if enabled else None, enabled=enabled)

    def _forward(self, model: torch.nn.Module, batch: Any, rows: slice, with_entropy: bool = False):
        return forward_rows(self, model, batch, rows, with_entropy)


class _Slots:
    """The child's view of the version history: version -> the model on that ring slot."""

    def __init__(self, models: list[torch.nn.Module], slots: dict[int, int]) -> None:
        self._models, self._slots = models, slots

    def versions(self) -> list[int]:
        return sorted(self._slots)

    def load(self, version: int, like: Any = None) -> torch.nn.Module:
        return self._models[self._slots[version]]


def _serve(tmp: str) -> None:
    """The child: map the ring (then remove its files, in ``tmp``), then one check per stdin message."""
    import copy

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    out = os.fdopen(os.dup(1), "wb")  # replies; anything a library prints goes to stderr
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    def reply(obj: Any) -> None:
        pickle.dump(obj, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    try:
        try:
            blob, paths, layout, nbytes, micro_batch_size, compute_dtype, threads, shared_prefix = pickle.load(inp)
            states = [map_slot(p, layout, nbytes) for p in paths]
        finally:  # both sides have mapped the slots (or this one never will): nothing left behind
            shutil.rmtree(tmp, ignore_errors=True)
            for p in paths:  # inherited descriptors (Linux): the mappings hold the memory now
                if p.startswith("/proc/self/fd/"):
                    with contextlib.suppress(OSError):
                        os.close(int(p.rsplit("/", 1)[1]))
        torch.set_num_threads(max(1, threads))
        model = pickle.loads(blob).eval().requires_grad_(False)
        del blob
        models = []
        for state in states:  # parameters and buffers become the slot's shared tensors (tied ones stay tied)
            m = copy.deepcopy(model) if models else model
            m.load_state_dict(state, assign=True)
            models.append(m.eval().requires_grad_(False))
    except Exception as e:  # noqa: BLE001 -- the trainer runs the check in line and says why
        reply((False, repr(e)))
        return
    reply((True, None))
    fwd = _Forwarder(micro_batch_size, compute_dtype, shared_prefix)
    while True:
        try:
            batch, version, slots, max_rows, seed = pickle.load(inp)
        except EOFError:
            return
        try:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                d = stale_absdiff(batch, version, _Slots(models, slots),
                                  lambda b, m: recompute_logprobs(fwd, b, m)[0], None, max_rows, generator=gen)
            reply((True, d))
        except Exception as e:  # noqa: BLE001 -- the trainer raises it after the step's bookkeeping
            reply((False, repr(e)))


if __name__ == "__main__":
    _serve(sys.argv[1])
