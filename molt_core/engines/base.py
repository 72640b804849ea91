"""The contract every rollout engine meets.

An engine takes prompt token ids and :class:`~molt_core.types.SamplingParams` and returns
the ids it sampled, each one's behaviour logprob under the distribution actually sampled
from (:mod:`molt_core.sampling`), the policy version that sampled each token (a weight sync
during a generation changes it mid-sequence: partial rollout), the finish reason and, for
MoE models, the routed experts. Weights arrive through one ``load_weights(state, version)``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from molt_core.types import GenerationOutput, SamplingParams

__all__ = ["GenerationOutput", "RolloutEngine", "WorkerThreadEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the ledger, server and runtime need from an engine.

    ``generate`` is a coroutine so many sessions share one engine; implementations batch
    concurrent requests (no one-request-at-a-time lock). ``load_weights`` swaps weights
    between decode steps and stamps later tokens with ``version``.
    """

    tokenizer: Any
    version: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       images: list[bytes] | None = None) -> GenerationOutput:
        """Sample a continuation of ``prompt_ids`` (list of int) under ``params``. ``images``: for
        vision-language engines, the encoded bytes of each image whose placeholder run
        (:func:`molt_plugins.vision.processor.expand_placeholders`) ``prompt_ids`` hold, in token order;
        text-only engines may omit the argument."""
        ...

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load ``state_dict`` (name -> tensor) as policy ``version``."""
        ...


class WorkerThreadEngine:
    """Plumbing shared by engines whose model runs in one background worker thread.

    Subclasses call :meth:`_init_worker` in their constructor (after their own state is set)
    and implement ``_loop`` (the thread body). Requests and weight updates reach the thread
    through ``self._cv`` (a :class:`threading.Condition`); ``self._pending_weights`` holds
    ``(payload, version, done_event, errors)`` tuples the loop applies between steps.
    """

    def _init_worker(self, target: Any, name: str, args: tuple = ()) -> None:
        import threading

        self._cv = threading.Condition()
        self._pending_weights: list[tuple[Any, int, Any, list]] = []
        self._paused = False
        self._closed = False
        self._worker = threading.Thread(target=target, args=args, name=name, daemon=True)

    def _queue_weights(self, payload: Any, version: int) -> None:
        """Hand ``payload`` to the worker, wait until it is applied; re-raise its error.

        Raises:
            RuntimeError: the engine is closed.
        """
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
        """Stop stepping after the current step; in-flight generations keep their state.
        Weight updates are still applied while paused."""
        with self._cv:
            self._paused = True

    def resume(self) -> None:
        """Resume stepping after :meth:`pause`."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @staticmethod
    def _deliver(r: Any, result: Any) -> None:
        """Resolve request ``r``'s future (``r.future`` on event loop ``r.loop``) with a
        :class:`GenerationOutput` or an exception, from the worker thread; a no-op when the
        future is already done or its loop is gone."""
        WorkerThreadEngine._deliver_many([(r, result)])

    @staticmethod
    def _deliver_many(items: list[tuple[Any, Any]]) -> None:
        """:meth:`_deliver` for several requests with one wake-up per event loop (each
        ``call_soon_threadsafe`` writes to the loop's self-pipe and hands it the GIL: 64 rows
        finishing in one decode step cost 64 wake-ups before)."""
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
    """A generate request's ``prompt_ids`` as ints and ``params`` as :class:`SamplingParams`
    (None: defaults; a dict: validated), after the checks every engine makes.

    Args:
        prompt_ids: the prompt's token ids (any int sequence).
        params: None, a dict or :class:`SamplingParams`.
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
