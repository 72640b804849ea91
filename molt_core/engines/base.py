"""The contract every rollout engine meets: prompt ids and :class:`~molt_core.types.SamplingParams` in;
sampled ids, their behaviour logprobs (:mod:`molt_core.sampling`), the policy version of each token (a
weight sync mid-generation changes it: partial rollout), the finish reason and, for MoE models, the
routed experts out. Weights arrive through one ``load_weights(state, version)``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from molt_core.types import GenerationOutput, SamplingParams

__all__ = ["GenerationOutput", "RolloutEngine", "WorkerThreadEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the ledger, server and runtime need from an engine: ``generate`` is a coroutine whose concurrent
    requests the engine batches; ``load_weights`` swaps weights between decode steps."""

    tokenizer: Any
    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Sample a continuation of ``prompt_ids`` under ``params``. ``images``: the encoded bytes of each image
        whose expanded placeholder run ``prompt_ids`` hold, in token order (text-only engines may omit it)."""
        ...

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load ``state_dict`` (name -> tensor) as policy ``version``."""
        ...


class WorkerThreadEngine:
    """Plumbing for engines whose model runs in one worker thread: subclasses call :meth:`_init_worker` and
    implement ``_loop``, which applies ``self._pending_weights`` (``(payload, version, done, errors)``) between
    steps; requests reach it through ``self._cv``."""

    def _init_worker(self, target: Any, name: str, args: tuple = ()) -> None:
        import threading

        self._cv = threading.Condition()
        self._pending_weights: list[tuple[Any, int, Any, list]] = []
        self._paused = False
        self._closed = False
        self._worker = threading.Thread(target=target, args=args, name=name, daemon=True)

    def _queue_weights(self, payload: Any, version: int) -> None:
        """Hand ``payload`` to the worker, wait until it is applied; re-raise its error.
        Raises: RuntimeError -- the engine is closed."""
        import threading

        done, err = threading.Event(), []
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._pending_weights.append((payload, int(version), done, err))
            self._cv.notify_all()
        done.wait()
        if err:
            raise err[0]

    def pause(self) -> None:
        """Stop stepping after the current step (generations keep their state; weights still load)."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        """Resume stepping after :meth:`pause`."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @staticmethod
    def _deliver(r: Any, result: Any) -> None:
        """Resolve ``r.future`` (on ``r.loop``) with a result or exception from the worker thread."""
        WorkerThreadEngine._deliver_many([(r, result)])

    @staticmethod
    def _deliver_many(items: list[tuple[Any, Any]]) -> None:
        """:meth:`_deliver` for several requests with one wake-up per event loop."""
        by_loop: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}
        for r, result in items:
            by_loop.setdefault(id(r.loop), (r.loop, []))[1].append((r, result))

        def _set(batch: list[tuple[Any, Any]]) -> None:
            for r, result in batch:
                if r.future.done():
                    continue
                if isinstance(result, BaseException):
                    r.future.set_exception(result)
                else:
                    r.future.set_result(result)

        for loop, batch in by_loop.values():
            try:
                loop.call_soon_threadsafe(_set, batch)
            except RuntimeError:  # the caller's event loop is gone
                pass

    def _stop_worker(self, timeout: float) -> None:
        """Mark closed, wake the worker and join it (``timeout`` seconds at most)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=timeout)


def checked_request(prompt_ids: Any, params: Any, context: int, vocab_size: int) -> tuple[list[int], SamplingParams]:
    """A generate request's ``prompt_ids`` as ints and ``params`` (None, dict or instance) as
    :class:`SamplingParams`, after the checks every engine makes.

    Args:
        context: the model's context in tokens; a prompt must leave room for one more.
        vocab_size: ids must lie in ``[0, vocab_size)``.

    Raises:
        ValueError: empty prompt, a prompt of ``context`` tokens or more, an id outside the vocabulary.
    """
    if params is None:
        params = SamplingParams()
    elif isinstance(params, dict):
        params = SamplingParams.model_validate(params)
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty; give at least one token id")
    if len(ids) >= context:
        raise ValueError(f"prompt_ids has {len(ids)} tokens but the model's context is {context}; shorten the prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_ids holds id {bad}, outside the vocabulary [0, {vocab_size})")
    return ids, params
