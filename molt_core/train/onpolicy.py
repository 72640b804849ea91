"""The trainer's side of the on-policy check of stale rows: run it in line, or in the check's
own process (:class:`molt_core.train.onpolicy_check.CheckProcess`) where that is safe and pays."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from molt_core.train.ingress import Batch
from molt_core.train.version_history import stale_absdiff

__all__ = ["OnPolicyChecks"]

#: the trainer module's logger (the check is part of the trainer)
log = logging.getLogger("molt_core.train.trainer")


class OnPolicyChecks:
    """The trainer's side of the on-policy check of stale rows (mixed into
    :class:`molt_core.train.trainer.Trainer`). Reads the trainer's ``cfg``, ``version``, ``history``,
    ``model``, ``device``, ``compute_dtype``, ``shared_prefix``, ``vision_processor``,
    ``replay_backend``, ``overlap_onpolicy_check`` and ``recompute_logprobs``."""

    def _onpolicy_stale(self, batch: Batch) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start measuring |behaviour - recomputed| ``[N]`` of the batch's tokens sampled by
        older versions, each under its own version's weights (:mod:`molt_core.train.version_history`);
        returns a function that waits for its ``(diffs, rows)``.

        Where it is safe (:attr:`overlap_onpolicy_check`, no routing replay, no images) and pays
        (a CPU trainer) the recompute runs in the check process beside the update; on an
        accelerator it stays in line. The result is the same tensor either way.
        """
        seed = self.cfg.run.seed * 1_000_003 + self.version  # a new sample each step
        version = self.version
        needed = (any(v < version for v in self.history.versions())
                  and bool((batch.versions[batch.mask] < version).any()))
        if needed and self._check_proc is not None and self._check_process_ok(batch) and self._check_ready():
            return self._check_proc.submit(batch, version, self.history.slots(), self.cfg.async_.onpolicy_rows, seed)
        gen = torch.Generator().manual_seed(seed)
        out = stale_absdiff(batch, version, self.history, lambda b, m: self.recompute_logprobs(b, model=m)[0],
                            self.model, self.cfg.async_.onpolicy_rows, generator=gen)
        return lambda: out

    def _check_process_ok(self, batch: Batch) -> bool:
        """Whether the on-policy check of ``batch`` may run in the check process."""
        return (self.overlap_onpolicy_check and self.device.type == "cpu" and batch.images is None
                and (self.replay_backend is None or batch.routed_experts is None))

    def _start_check_process(self) -> None:
        """Start the check process once, if this trainer may use it (one CPU process keeping versions,
        no VL model, no routing replay): the history moves to its shared ring; checks run in line
        until the child is ready, and for good (logged once) if it cannot start."""
        if (self._check_proc is not None or self._check_proc_failed or not self.overlap_onpolicy_check
                or self.device.type != "cpu" or self.history.keep == 0 or self.vision_processor is not None
                or self.replay_backend is not None):
            return
        # here, not at the top: the check's child runs ``python -m molt_core.train.onpolicy_check``, and
        # a copy imported with the package first would make runpy load it twice (RuntimeWarning)
        from molt_core.train.onpolicy_check import CheckProcess

        try:
            proc = CheckProcess(self.model, self.history.keep + 1, self.cfg.trainer.micro_batch_size,
                                self.compute_dtype, torch.get_num_threads(), self.shared_prefix)
            self.history.share(proc.ring)  # the held versions move to shared memory
            self._check_proc = proc
        except Exception as e:  # noqa: BLE001 -- the in-line check measures the same thing
            self._check_failed(e)

    def start_check_process(self) -> bool:
        """Start the on-policy check's process now rather than after the first update (the run
        loop calls it after the warm start, so the child's start-up overlaps the first rollouts).
        Returns whether a check process runs (see :meth:`_start_check_process`)."""
        self._start_check_process()
        return self._check_proc is not None

    def close(self) -> None:
        """Stop the on-policy check's process, if one runs; the check then runs in line. Idempotent."""
        if self._check_proc is not None:
            self._check_proc.close()
            self._check_proc = None
        self._check_proc_failed = True  # no new one

    def _check_ready(self) -> bool:
        """Whether the check process can take this step's check (never waits)."""
        try:
            return bool(self._check_proc is not None and self._check_proc.ready())
        except RuntimeError as e:
            self._check_proc = None
            self._check_failed(e)
            return False

    def _check_failed(self, e: BaseException) -> None:
        self._check_proc_failed = True
        log.warning("the on-policy check runs in line (its process could not start: %s)", e)
