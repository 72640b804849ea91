"""Reward scoring: how the runtime calls the reward plugins (:mod:`molt_core.rewards`) on a finished
group. A call runs in a reward worker process (``isolation = "process"``, killed with ``SIGKILL`` at
its deadline) or a fresh daemon thread (``"thread"``: the step stops waiting at the deadline), never on
the worker's event loop; every call of a worker shares one semaphore of ``rollout.reward_concurrency``
slots. Semantics and defaults: docs/rewards.md ("Where a reward runs").
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import inspect
import math
import sys
import threading
from typing import Any, Awaitable, Callable

from molt_core.rewards import _JUDGE, PROCESS_START_TIMEOUT_S, JudgeEndpoint, RewardSpec, Rollout, _dump_fn, as_score, reward_spec
from molt_core.rollout.reward_worker import read_frame, write_frame
from molt_core.types import Group, RewardFailed, Trajectory

__all__ = ["RewardRunner", "score_group", "component_metrics"]


class _Failed(Exception):
    """One reward call failed; ``str`` is the trajectory's error."""

def _finish_thread(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():  # timed out: the late result is discarded
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _drive(aw: Any, holder: dict[str, Any]) -> Any:
    """Run ``aw`` on a fresh event loop of this thread; ``holder`` gets the loop and task (for cancelling)."""
    async def main() -> Any:
        return await aw

    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(main())
        holder["loop"], holder["task"] = loop, task
        return loop.run_until_complete(task)
    finally:
        holder.pop("loop", None)
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _cancel_remote(holder: dict[str, Any]) -> None:
    loop, task = holder.get("loop"), holder.get("task")
    if loop is not None and task is not None:
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # that loop already closed
            pass


async def _run_sync(fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> Any:
    """Run ``fn`` (an awaitable result: on a fresh loop there) in a fresh daemon thread with this task's
    context; cancelling the caller cancels that coroutine. Never a pool: a hung reward must not starve others."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()
    ctx = contextvars.copy_context()
    holder: dict[str, Any] = {}

    def target() -> None:
        try:
            out = ctx.run(fn, *args, **kwargs)
            if inspect.isawaitable(out):
                out = ctx.run(_drive, out, holder)
            err = None
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting task
            out, err = None, e
        try:
            loop.call_soon_threadsafe(_finish_thread, fut, out, err)
        except RuntimeError:  # the loop is gone: nobody waits for this result
            pass

    threading.Thread(target=target, daemon=True, name=f"molt-reward-{name}").start()
    try:
        return await fut
    except asyncio.CancelledError:
        _cancel_remote(holder)
        raise


class _WorkerDied(Exception):
    """The reward worker process ended during a call."""


class _ProcessWorker:
    """One reward worker process (:mod:`molt_core.rollout.reward_worker`) holding one function."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        """Start the process on a long-lived thread (it is killed when its starting thread ends);
        :meth:`ready` sends ``fn`` and waits for it to load."""
        import os
        import pickle
        import subprocess
        import sys

        self._read, self._write, self.name = read_frame, write_frame, name
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["MOLT_REWARD_PARENT"] = str(os.getpid())
        self.proc = subprocess.Popen([sys.executable, "-c", "from molt_core.rollout.reward_worker import main; main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._init = pickle.dumps((list(sys.path), _dump_fn(fn)))

    def ready(self) -> "_ProcessWorker":
        """Send the function and wait until the process has loaded it (blocking).

        Raises:
            RuntimeError: the process could not load the function.
            EOFError / OSError: the process died.
        """
        import pickle

        try:
            self._write(self.proc.stdin, self._init)
            tag, val = pickle.loads(self._read(self.proc.stdout))
        except BaseException:
            self.kill()
            raise
        if tag != "ready":
            self.kill()
            raise RuntimeError(f"reward {self.name}: the reward process could not load the function: "
                               f"{type(val).__name__}: {val}")
        return self

    def call(self, args: tuple, kwargs: dict) -> Any:
        """One call (blocking); the reward's result, or its exception re-raised."""
        import pickle

        data = pickle.dumps((args, kwargs))
        try:
            self._write(self.proc.stdin, data)
            frame = self._read(self.proc.stdout)
        except (EOFError, BrokenPipeError, ValueError) as e:  # ValueError: the pipe was closed by kill()
            raise _WorkerDied(str(e)) from None
        tag, val = pickle.loads(frame)
        if tag == "err":
            raise val
        return val

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """``SIGKILL`` the process and its process group; reap it."""
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 -- best effort
            pass


# id(fn) -> (fn, idle workers); holding fn keeps its id from being reused while its workers are kept
_POOLS: dict[int, tuple[Callable[..., Any], list[_ProcessWorker]]] = {}
_POOL_LOCK = threading.Lock()


def _idle(fn: Callable[..., Any]) -> list[_ProcessWorker]:
    """The idle-worker list of ``fn`` (call with ``_POOL_LOCK`` held)."""
    entry = _POOLS.get(id(fn))
    if entry is None or entry[0] is not fn:
        entry = _POOLS[id(fn)] = (fn, [])
    return entry[1]


def _close_pools() -> None:
    with _POOL_LOCK:
        workers = [w for _, ws in _POOLS.values() for w in ws]
        _POOLS.clear()
    for w in workers:
        w.kill()


atexit.register(_close_pools)


async def _run_process(spec: RewardSpec, args: tuple, kwargs: dict) -> Any:
    """Run one call in an idle worker process of ``spec`` (started when none is idle, outside the deadline),
    bounded by ``spec.timeout_s``; at the deadline the process is killed.

    Raises:
        TimeoutError: the deadline passed (the worker is killed).
        RewardFailed: ``crash`` -- the worker could not start, or died during the call.
    """
    with _POOL_LOCK:
        idle = _idle(spec.fn)
        w = None
        while idle and w is None:
            w = idle.pop()
            if not w.alive():
                w.kill()
                w = None
    if w is None:
        try:
            w = _ProcessWorker(spec.fn, spec.name)  # here, on the loop's thread (see its docstring)
        except OSError as e:
            raise RewardFailed("crash", f"the reward process could not start: {e}") from None
        try:
            async with asyncio.timeout(PROCESS_START_TIMEOUT_S):
                await _run_sync(w.ready, (), {}, f"{spec.name}-start")
        except TimeoutError:
            w.kill()
            raise RewardFailed("crash", f"the reward process did not start within {PROCESS_START_TIMEOUT_S:g} s") from None
        except (OSError, EOFError, RuntimeError) as e:
            w.kill()
            raise RewardFailed("crash", f"the reward process could not start: {e}") from None
        except BaseException:
            w.kill()
            raise
    try:
        async with asyncio.timeout(spec.timeout_s):
            out = await _run_sync(w.call, (args, kwargs), {}, spec.name)
    except _WorkerDied:
        w.kill()
        raise RewardFailed("crash", f"the reward process died (exit {w.proc.returncode})") from None
    except BaseException:
        if not w.alive():
            w.kill()
        elif isinstance(sys.exc_info()[1], (TimeoutError, asyncio.CancelledError)):
            w.kill()
        else:
            with _POOL_LOCK:
                _idle(spec.fn).append(w)
        raise
    with _POOL_LOCK:
        _idle(spec.fn).append(w)
    return out


async def _call(spec: RewardSpec, args: tuple, kwargs: dict, slots: asyncio.Semaphore,
                open_session: Callable[[], tuple[JudgeEndpoint, Callable[[], None]]] | None) -> Any:
    """One bounded reward call. Raises :class:`_Failed` with the trajectory's error text."""
    name = spec.name
    async with slots:
        close = None
        token = None
        try:
            if spec.isolation == "process":
                return await _run_process(spec, args, kwargs)
            if spec.judge_session and open_session is not None:
                endpoint, close = open_session()
                token = _JUDGE.set(endpoint)
            async with asyncio.timeout(spec.timeout_s):
                return await _run_sync(spec.fn, args, kwargs, name)
        except TimeoutError:
            raise _Failed(f"reward {name}: {RewardFailed('timeout', f'no score within {spec.timeout_s:g} s (rewards.{name}.timeout_s)')}") from None
        except RewardFailed as e:
            raise _Failed(f"reward {name}: {e}") from None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failing reward marks the trajectory failed
            raise _Failed(f"reward {name} raised {type(e).__name__}: {e}") from None
        finally:
            if token is not None:
                _JUDGE.reset(token)
            if close is not None:
                close()


def _check(value: Any, name: str) -> float:
    try:
        return as_score(value, f"reward {name}")
    except RewardFailed as e:
        raise _Failed(f"reward {name}: {e}") from None


async def _per_response(spec: RewardSpec, item: tuple[Trajectory, Rollout], slots: asyncio.Semaphore,
                        open_session: Any) -> float:
    traj, ro = item
    kw = dict(spec.options)
    if spec.trajectory:
        kw["trajectory"] = ro
    return _check(await _call(spec, (ro.response, ro.task), kw, slots, open_session), spec.name)


async def _per_group(spec: RewardSpec, items: list[tuple[Trajectory, Rollout]], slots: asyncio.Semaphore,
                     open_session: Any) -> list[float | _Failed]:
    kw = dict(spec.options)
    if spec.trajectory:
        kw["trajectories"] = [ro for _, ro in items]
    out = await _call(spec, ([ro.response for _, ro in items], [ro.task for _, ro in items]), kw, slots, open_session)
    vals = _group_scores(out, len(items), spec.name)
    res: list[float | _Failed] = []
    for v in vals:  # one bad score fails its own rollout only
        try:
            res.append(_check(v, spec.name))
        except _Failed as e:
            res.append(e)
    return res


def _group_scores(out: Any, n: int, name: str) -> list[Any]:
    """The ``n`` scores of a group reward's output (a list, tuple or 1-d array of length ``n``); else
    :class:`_Failed` (``bad_output``)."""
    shape = getattr(out, "shape", None)
    if isinstance(out, (list, tuple)):
        vals: list[Any] | None = list(out)
    elif shape is not None and hasattr(out, "tolist") and len(shape) == 1:
        vals = list(out)
    else:
        vals = None
    if vals is None or len(vals) != n:
        got = f"{len(vals)} scores" if vals is not None else (
            f"an array of shape {tuple(shape)}" if shape is not None else type(out).__name__)
        raise _Failed(f"reward {name}: {RewardFailed('bad_output', f'a group reward must return a list of one score per response: {n} responses, got {got}')}")
    return vals


async def score_group(specs: list[RewardSpec], items: list[tuple[Trajectory, Rollout | None]], slots: asyncio.Semaphore,
                      open_session: Callable[[], tuple[JudgeEndpoint, Callable[[], None]]] | None = None,
                      agent_label: str = "agent") -> list[Trajectory]:
    """Score one group's finished rollouts; returns the trajectories in the same order.

    ``items`` pairs each trajectory with its :class:`Rollout` (None: already failed, passed through). Each
    ok trajectory's own reward / score must be finite (``agent_label`` names it), then every reward runs
    concurrently under ``slots``; a bad score fails only its rollout. An ok result gets ``reward = own +
    sum(weight * score)`` and ``info["rewards"]``; a failed one the first failing reward's error (recipe
    order) and ``info["rewards_failed"]``. Never raises for a reward's fault.
    """
    out: list[Trajectory] = [t for t, _ in items]
    live: list[int] = []
    for i, (t, ro) in enumerate(items):
        if t.status != "ok" or ro is None:
            continue
        try:
            as_score(0.0 if t.reward is None else t.reward, f"{agent_label} Result.reward")
            if t.score is not None:
                as_score(t.score, f"{agent_label} Result.score")
        except RewardFailed as e:
            out[i] = t.fail(f"{agent_label}: {e}")
            continue
        live.append(i)
    if not specs or not live:
        return out
    calls: list[tuple[RewardSpec, list[int], Awaitable[Any]]] = []
    for spec in specs:
        if spec.group:
            calls.append((spec, live, _per_group(spec, [items[i] for i in live], slots, open_session)))  # type: ignore[misc]
        else:
            for i in live:
                calls.append((spec, [i], _per_response(spec, items[i], slots, open_session)))  # type: ignore[arg-type]
    results = await asyncio.gather(*(c for _, _, c in calls), return_exceptions=True)
    scores: dict[int, dict[str, float]] = {i: {} for i in live}
    errors: dict[int, dict[str, str]] = {i: {} for i in live}
    for (spec, idx, _), res in zip(calls, results):
        if isinstance(res, BaseException):
            msg = str(res) if isinstance(res, _Failed) else f"reward {spec.name} raised {type(res).__name__}: {res}"
            for i in idx:
                errors[i][spec.name] = msg
        else:
            vals = res if spec.group else [res]
            for i, v in zip(idx, vals):
                if isinstance(v, _Failed):
                    errors[i][spec.name] = str(v)
                else:
                    scores[i][spec.name] = v
    for i in live:
        t = out[i]
        info = {**t.info, "rewards": scores[i]}
        if errors[i]:
            first = next(s.name for s in specs if s.name in errors[i])
            info["rewards_failed"] = [s.name for s in specs if s.name in errors[i]]
            out[i] = t.model_copy(update={"info": info}).fail(errors[i][first])
        else:
            total = (t.reward or 0.0) + sum(s.weight * scores[i][s.name] for s in specs)
            if not math.isfinite(total):  # finite parts, weighted sum overflowed
                out[i] = t.model_copy(update={"info": info}).fail(
                    f"reward: {RewardFailed('non_finite', f'the weighted sum of the rewards is {total}')}")
                continue
            out[i] = t.model_copy(update={"info": info, "reward": total})
    return out


class RewardRunner:
    """A rollout worker's rewards: specs, the concurrency limit (a semaphore per event loop), the judge opener.

    Args:
        tables: the recipe's ``rewards`` mapping (name -> table).
        lookup: ``name -> registered reward`` (raises ``KeyError`` for an unknown name).
        concurrency: ``rollout.reward_concurrency``.
        open_session: opens one loopback judge session, returning ``(JudgeEndpoint, close)``.

    Raises:
        KeyError / ValueError: an unknown reward, or bad reserved keys (see :func:`reward_spec`).
    """

    def __init__(self, tables: dict[str, dict[str, Any]], lookup: Callable[[str], Any], concurrency: int,
                 open_session: Callable[[], tuple[JudgeEndpoint, Callable[[], None]]] | None = None) -> None:
        self.specs = [reward_spec(name, lookup(name), table) for name, table in tables.items()]
        self.concurrency = concurrency
        self.open_session = open_session
        self._slots: dict[Any, asyncio.Semaphore] = {}

    @property
    def wants_judge_session(self) -> bool:
        """Whether some reward asks the run's own engine (needs the loopback server)."""
        return any(s.judge_session for s in self.specs)

    def slots(self) -> asyncio.Semaphore:
        """The semaphore of the running event loop (created on first use)."""
        loop = asyncio.get_running_loop()
        sem = self._slots.get(loop)
        if sem is None:
            self._slots = {lp: s for lp, s in self._slots.items() if not lp.is_closed()}
            sem = self._slots[loop] = asyncio.Semaphore(self.concurrency)
        return sem

    async def score(self, items: list[tuple[Trajectory, Rollout | None]], agent_label: str = "agent") -> list[Trajectory]:
        """:func:`score_group` with this worker's specs, slots and judge sessions."""
        return await score_group(self.specs, items, self.slots(), open_session=self.open_session, agent_label=agent_label)


def component_metrics(groups: list[Group], names: list[str]) -> dict[str, float]:
    """``reward/NAME/mean`` (unweighted, over the ok trajectories that have it; NaN: none) and ``/failed``."""
    m: dict[str, float] = {}
    trajs = [t for g in groups for t in g.trajectories]
    for name in names:
        vals = [t.info["rewards"][name] for t in trajs if t.status == "ok" and name in (t.info.get("rewards") or {})]
        m[f"reward/{name}/mean"] = sum(vals) / len(vals) if vals else float("nan")
        m[f"reward/{name}/failed"] = float(sum(name in (t.info.get("rewards_failed") or []) for t in trajs))
    return m
