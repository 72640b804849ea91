"""Reward authoring (Reward API v2; the contract: docs/rewards.md). A reward is ``fn(response, task,
**options) -> float``, a :func:`group_reward`, or one given the whole :class:`Rollout`; its
``[rewards.NAME]`` table holds its options and the :data:`RESERVED_KEYS` the runtime reads."""

from __future__ import annotations

import contextvars
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from molt_core import _moved
from molt_core.types import RewardFailed, Trajectory

__all__ = ["RESERVED_KEYS", "DEFAULT_TIMEOUT_S", "PROCESS_START_TIMEOUT_S", "Rollout", "RewardSpec", "JudgeEndpoint",
           "group_reward", "reward_spec", "judge_endpoint", "as_score"]

RESERVED_KEYS = ("weight", "timeout_s", "isolation")
DEFAULT_TIMEOUT_S = 60.0
#: seconds a reward process may take to start, not charged to the reward's deadline (else ``crash``)
PROCESS_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class JudgeEndpoint:
    """An OpenAI-compatible endpoint (``base_url`` ending in ``/v1``, ``api_key``) for one judge call."""

    base_url: str
    api_key: str


_JUDGE: contextvars.ContextVar[JudgeEndpoint | None] = contextvars.ContextVar("molt_judge_endpoint", default=None)


def judge_endpoint() -> JudgeEndpoint | None:
    """The loopback judge session opened for the reward call in progress (None outside one)."""
    return _JUDGE.get()


@dataclass(frozen=True)
class Rollout:
    """The whole rollout: final ``response`` text, ``task``, chat ``messages`` (OpenAI form, tool
    calls included) and the token-level ``trajectory``."""

    response: str
    task: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    trajectory: Trajectory | None = None

    @property
    def turns(self) -> int:
        """Assistant messages in the rollout (model turns)."""
        return sum(m.get("role") == "assistant" for m in self.messages)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """Every tool call the model made, in order."""
        return [c for m in self.messages if m.get("role") == "assistant" for c in (m.get("tool_calls") or [])]


def group_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a group reward: ``fn(responses, tasks, **options) -> list[float]``."""
    fn.molt_group = True  # type: ignore[attr-defined]
    return fn


def _flag(fn: Any, attr: str, options: dict[str, Any]) -> bool:
    v = getattr(fn, attr, False)
    return bool(v(options)) if callable(v) else bool(v)


def _accepts(fn: Any, param: str) -> bool:
    try:
        p = inspect.signature(fn).parameters.get(param)
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass(frozen=True)
class RewardSpec:
    """How the runtime calls one configured reward (built by :func:`reward_spec`)."""

    name: str
    fn: Callable[..., Any]
    options: dict[str, Any]
    weight: float = 1.0
    timeout_s: float = DEFAULT_TIMEOUT_S
    group: bool = False
    trajectory: bool = False
    is_async: bool = False
    judge_session: bool = False
    isolation: str = "thread"


def reward_spec(name: str, fn: Callable[..., Any], table: dict[str, Any]) -> RewardSpec:
    """Split a ``[rewards.<name>]`` table into reserved keys and options, and decide the calling
    convention; the bound on one call is the reward's ``molt_timeout(options)``, else ``timeout_s``.

    Raises:
        ValueError: naming ``rewards.<name>.weight`` (not finite), ``.timeout_s`` (not positive),
            ``.isolation`` (not thread / process, or process for an unpicklable or judge reward).
    """
    table = dict(table)
    weight, timeout = table.get("weight", 1.0), table.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"rewards.{name}.weight = {weight!r}: must be a finite number (e.g. weight = 0.5)")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (0 < float(timeout) < math.inf):
        raise ValueError(f"rewards.{name}.timeout_s = {timeout!r}: must be a positive number of seconds (e.g. timeout_s = 30)")
    model = getattr(fn, "Options", None)
    declared = set(getattr(model, "model_fields", {}) or {})
    options = {k: v for k, v in table.items() if k not in RESERVED_KEYS or k in declared}
    group = _flag(fn, "molt_group", options)
    traj = _flag(fn, "molt_trajectory", options) or _accepts(fn, "trajectories" if group else "trajectory")
    judge = _flag(fn, "molt_judge_session", options)
    bound = getattr(fn, "molt_timeout", None)
    if callable(bound):
        timeout = bound(options)
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (0 < float(timeout) < math.inf):
            raise ValueError(f"rewards.{name}: the reward's molt_timeout gave {timeout!r}, not a positive number of seconds")
    iso = table.get("isolation", getattr(fn, "molt_isolation", "thread"))
    if iso not in ("thread", "process"):
        raise ValueError(f"rewards.{name}.isolation = {iso!r}: must be 'thread' or 'process'")
    if iso == "process":
        if judge:
            raise ValueError(f"rewards.{name}.isolation = 'process': this reward asks the run's own engine "
                             f"(judge session), which a reward process cannot reach; use 'thread'")
        try:
            _dump_fn(fn)
        except Exception as e:  # noqa: BLE001 -- any pickling failure
            raise ValueError(f"rewards.{name}.isolation = 'process': the reward cannot be sent to a process "
                             f"({type(e).__name__}: {e}); use 'thread'") from None
    return RewardSpec(name=name, fn=fn, options=options, weight=float(weight), timeout_s=float(timeout), group=group,
                      trajectory=traj, is_async=_is_async(fn), judge_session=judge, isolation=iso)


def as_score(value: Any, what: str) -> float:
    """``value`` (a real number or a 0-d object with ``__float__``) as a finite float.

    Raises:
        RewardFailed: ``not_a_number`` (None, a string, a list...) or ``non_finite`` (NaN, +-inf,
            beyond the float range), naming ``what``.
    """
    if isinstance(value, (str, bytes)) or value is None or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise RewardFailed("not_a_number", f"{what} returned {type(value).__name__} {value!r:.60}; return a finite float")
    try:
        f = float(value)
    except OverflowError:  # an int / Fraction beyond the float range
        raise RewardFailed("non_finite", f"{what} returned {type(value).__name__} beyond the float range") from None
    except (TypeError, ValueError) as e:
        raise RewardFailed("not_a_number", f"{what} returned {type(value).__name__}: {e}") from None
    if not math.isfinite(f):
        raise RewardFailed("non_finite", f"{what} returned {f}; a reward must be a finite number")
    return f


def _dump_fn(fn: Callable[..., Any]) -> bytes:
    """``fn`` pickled for a reward process: by reference when importable, else by value (cloudpickle)."""
    import pickle

    try:
        blob = pickle.dumps(fn)
        if getattr(fn, "__module__", None) != "__main__":
            return blob
    except Exception:  # noqa: BLE001 -- try by value
        pass
    import cloudpickle

    return cloudpickle.dumps(fn)


def __getattr__(name: str) -> object:
    """Names that moved to :mod:`molt_core.rollout.scoring` (deprecated here)."""
    return _moved.moved_attr(__name__, name)
