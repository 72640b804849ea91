"""The on-policy check of stale rows in a process of its own, beside the update.

An asynchronous step measures its tokens sampled by older versions under those versions'
weights (:func:`molt_core.version_history.stale_absdiff`): one extra no-grad forward per step.
Run on a thread of the trainer process, that forward shares the interpreter lock with the
update and lengthens the step (tiny Qwen3 quickstart, 2 CPU cores: about 35-50 ms of a
~200 ms step). :class:`CheckProcess` runs it in a child process instead, so on a multi-core
CPU it costs the update nothing but the copy of the weights that :meth:`VersionHistory.record`
makes anyway:

* the version history's copies live in shared memory (:meth:`VersionHistory.share`, a ring of
  ``max_staleness + 1`` state dicts), handed to the child once; the child holds one model per
  ring slot whose parameters *are* that slot's tensors, so no weights travel per step;
* per step the trainer sends the batch, the version it trains and which slot holds each older
  version; the child runs the same :func:`~molt_core.version_history.stale_absdiff` over the
  same micro-batches and autocast as the trainer (:func:`molt_core.train.forward.recompute_logprobs`)
  and sends back the ``[N]`` float64 differences -- bit-identical to the check run in line
  (tests/test_onpolicy_consistency.py).

Used by :class:`molt_core.train.Trainer` for a one-process CPU trainer with no images and no
routing replay (:meth:`molt_core.train.Trainer._onpolicy_stale`); elsewhere the check stays in
line. If the child cannot be started (the model cannot be pickled, no shared memory), the
trainer falls back to the in-line check and logs why, once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
from typing import Any, Callable

import torch

from molt_core.version_history import stale_absdiff

__all__ = ["CheckProcess"]

log = logging.getLogger(__name__)


class CheckProcess:
    """A child process that runs the on-policy check of stale rows.

    Args:
        model: the policy (a template: pickled once to the child, which builds one copy per
            ring slot, its parameters replaced by that slot's shared tensors).
        ring: the shared-memory state dicts of :meth:`VersionHistory.share` (``keep + 1`` of
            them, same keys as ``model.state_dict()``).
        micro_batch_size: rows per forward (``trainer.micro_batch_size``: the trainer's split).
        compute_dtype: the forwards' autocast dtype (``torch.float32``: none).
        threads: torch threads of the child (the trainer's ``torch.get_num_threads()``, so its
            kernels reduce in the same order as an in-line check's).

    Raises:
        Exception: whatever pickling the model or starting the process raises (the caller
            falls back to the in-line check).
    """

    def __init__(self, model: torch.nn.Module, ring: list[dict[str, torch.Tensor]], micro_batch_size: int,
                 compute_dtype: torch.dtype, threads: int) -> None:
        import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor pickling)

        ctx = mp.get_context("spawn")  # not fork: the trainer may hold threads (Ray, OpenMP)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model, ring, micro_batch_size, compute_dtype, threads),
                                 name="molt-onpolicy-check", daemon=True)
        self._proc.start()
        child.close()
        self._busy = False

    def submit(self, batch: Any, version: int, slots: dict[int, int], max_rows: int,
               seed: int) -> Callable[[], torch.Tensor]:
        """Start the check of ``batch`` (a :class:`~molt_core.train.ingress.Batch` without images
        or routing) at trainer ``version``; ``slots`` maps each held older version to its ring
        slot; ``max_rows`` and ``seed`` as :func:`stale_absdiff`'s sample. Returns a function
        that waits for the ``[N]`` float64 differences.

        The ring slots read must not be written (:meth:`VersionHistory.record`) before the
        result is taken: the ring's spare slot guarantees it for one check in flight.

        Raises:
            RuntimeError: the child is dead (here), or it failed (its error's text) or died
                during the check (from the returned function).
        """
        if self._busy:
            raise RuntimeError("internal: a second on-policy check was submitted before the first was taken")
        try:
            self._conn.send((batch, version, slots, max_rows, seed))
        except OSError as e:  # a broken pipe: the child is gone
            raise RuntimeError(f"the on-policy check process died (exit code {self._proc.exitcode})") from e
        self._busy = True

        def result() -> torch.Tensor:
            self._busy = False
            try:
                ok, out = self._conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"the on-policy check process died (exit code {self._proc.exitcode})") from e
            if not ok:
                raise RuntimeError(f"the on-policy check process failed: {out}")
            return out

        return result

    def close(self) -> None:
        """Stop the child (it exits when its pipe closes; killed after 5 s)."""
        with contextlib.suppress(OSError):
            self._conn.close()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()


class _Forwarder:
    """What :func:`molt_core.train.forward.recompute_logprobs` reads of a one-process CPU
    trainer with no images and no routing replay: its micro-batches and autocast."""

    device = torch.device("cpu")
    lockstep = False
    vision_processor = None

    def __init__(self, micro_batch_size: int, compute_dtype: torch.dtype) -> None:
        self.micro_batch_size = micro_batch_size
        self.compute_dtype = compute_dtype

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
        from molt_core.train.forward import forward_rows

        return forward_rows(self, model, batch, rows, with_entropy)


class _Slots:
    """The child's view of the version history: version -> the model on that ring slot."""

    def __init__(self, models: list[torch.nn.Module], slots: dict[int, int]) -> None:
        self._models, self._slots = models, slots

    def versions(self) -> list[int]:
        return sorted(self._slots)

    def load(self, version: int, like: Any = None) -> torch.nn.Module:
        return self._models[self._slots[version]]


def _serve(conn: Any, model: torch.nn.Module, ring: list[dict[str, torch.Tensor]], micro_batch_size: int,
           compute_dtype: torch.dtype, threads: int) -> None:
    """The child's loop: one check per message until the pipe closes."""
    import copy

    from molt_core.train.forward import recompute_logprobs

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    torch.set_num_threads(max(1, threads))
    model.eval().requires_grad_(False)
    models = []
    for state in ring:  # parameters and buffers become the slot's shared tensors (tied ones stay tied)
        m = copy.deepcopy(model) if models else model
        m.load_state_dict(state, assign=True)
        models.append(m.eval().requires_grad_(False))
    fwd = _Forwarder(micro_batch_size, compute_dtype)
    while True:
        try:
            batch, version, slots, max_rows, seed = conn.recv()
        except (EOFError, OSError):
            return
        try:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                out = stale_absdiff(batch, version, _Slots(models, slots),
                                    lambda b, m: recompute_logprobs(fwd, b, m)[0], None, max_rows, generator=gen)
            conn.send((True, out))
        except Exception as e:  # noqa: BLE001 -- the trainer raises it after the step's bookkeeping
            conn.send((False, repr(e)))
