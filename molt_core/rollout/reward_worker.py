"""The child side of a process-isolated reward (``isolation = "process"``): a loop that loads one
reward function and calls it on request over length-prefixed frames (:func:`main`).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

__all__ = ["main", "read_frame", "write_frame"]


def read_frame(f) -> bytes:
    """One frame from the binary stream ``f``. Raises: EOFError -- the stream ended (before or inside a frame)."""
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("reward worker pipe closed")
    (n,) = struct.unpack("<Q", head)
    body = f.read(n)
    if len(body) < n:
        raise EOFError("reward worker pipe closed inside a frame")
    return body


def write_frame(f, data: bytes) -> None:
    """Write ``data`` as one frame to the binary stream ``f`` and flush it."""
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _dumps(obj) -> bytes:
    try:
        return pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 -- an unpicklable result or exception
        tag, val = obj
        what = "result" if tag == "ok" else "exception"
        return pickle.dumps(("err", TypeError(f"the reward's {what} {type(val).__name__} cannot be sent back: {e}")))


def _die_with_parent() -> None:
    """Ask for ``SIGKILL`` when the thread that started this process ends (Linux); exit if it already has."""
    parent = os.environ.get("MOLT_REWARD_PARENT")
    if sys.platform != "linux" or not parent:
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        os._exit(0)


def main() -> None:
    """Serve calls of one reward function until the input ends.

    The parent sends ``pickle((sys_path, fn_bytes))`` and gets ``("ready", None)`` or ``("err", exception)``;
    then per call ``pickle((args, kwargs))`` -> ``("ok", value)`` or ``("err", exception)``. The reward's
    prints go to stderr, never into the protocol stream.
    """
    _die_with_parent()
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr
    sys.stdout = sys.stderr
    inp = os.fdopen(0, "rb")
    try:
        path, blob = pickle.loads(read_frame(inp))
        sys.path[:] = path
        try:
            import cloudpickle as _cp  # noqa: F401 -- by-value functions need it to load
        except ImportError:
            pass
        fn = pickle.loads(blob)
        write_frame(proto_out, _dumps(("ready", None)))
    except EOFError:
        return
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        write_frame(proto_out, _dumps(("err", e)))
        return
    import asyncio
    import inspect

    while True:
        try:
            args, kwargs = pickle.loads(read_frame(inp))
        except EOFError:
            return
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                async def _await(aw=out):
                    return await aw
                out = asyncio.run(_await())
            msg = ("ok", out)
        except BaseException as e:  # noqa: BLE001 -- reported to the parent
            msg = ("err", e)
        write_frame(proto_out, _dumps(msg))


if __name__ == "__main__":
    main()
