"""Score a registered reward outside a run, exactly as the runtime does.

:func:`score_reward` (re-exported by :mod:`molt_core.testing`, used by the conformance checks
of :mod:`molt_core.testing.conformance`) builds a one-segment rollout per response and calls
:func:`molt_core.rollout.scoring.score_group`; a call the runtime would mark failed raises
:class:`RewardCallFailed` with the trajectory's error text.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from molt_core.types import Segment, Trajectory

__all__ = ["RewardCallFailed", "score_reward"]


class RewardCallFailed(AssertionError):
    """The runtime would mark the trajectory ``failed`` for this reward call; ``error`` is
    the trajectory's error text, e.g.
    ``reward brevity: failed: timeout (no score within 1 s (rewards.brevity.timeout_s))``."""

    def __init__(self, error: str) -> None:
        super().__init__(error)
        self.error = error


def _rollout_stub(response: str, task: dict[str, Any], tokenizer: Any | None) -> Any:
    from molt_core.rewards import Rollout

    ids = tokenizer.encode(response, add_special_tokens=False) if tokenizer is not None else [0] * max(1, len(response))
    ids = ids or [0]
    seg = Segment(token_ids=[0, *ids], loss_mask=[False] + [True] * len(ids), logprobs=[None] + [-0.1] * len(ids),
                  versions=[None] + [0] * len(ids), finish_reason="stop")
    traj = Trajectory(segments=[seg], task=task, reward=0.0)
    messages = [{"role": "user", "content": str(task.get("question", task.get("prompt", "")))},
                {"role": "assistant", "content": response}]
    return traj, Rollout(response=response, task=task, messages=messages, trajectory=traj)


def score_reward(reward: Any, responses: str | Sequence[str], tasks: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 *, name: str | None = None, table: dict[str, Any] | None = None, tokenizer: Any | None = None,
                 **options: Any) -> float | list[float]:
    """Score ``responses`` with ``reward`` the way the runtime does
    (:func:`molt_core.rewards.reward_spec` + :func:`molt_core.rollout.scoring.score_group`).

    ``reward`` is a registered reward object or a name looked up among the installed plugins;
    ``name`` (default: that name, else ``reward.__name__``) is the name in error messages.
    ``table`` (or ``options``) is the recipe's ``[rewards.<name>]`` table: options plus the
    reserved ``weight`` / ``timeout_s``. One response -> one float; a list of responses is
    scored as one group (what a group reward sees) -> one float per response. ``tasks`` is
    one task dict for all responses (default ``{}``) or one per response. A reward wanting the
    rollout gets a :class:`~molt_core.rewards.Rollout` with a two-message chat and a
    one-segment trajectory (ids from ``tokenizer`` when given). Call it from synchronous code
    (it runs its own event loop with ``asyncio.run``).

    Returns:
        The unweighted score(s), as recorded in ``info["rewards"][name]`` (``weight`` only
        scales the reward's share of the trajectory's total; see :func:`molt_core.testing.run_episode`).

    Raises:
        RewardCallFailed: the reward raised, timed out, or returned a non-finite number or
            the wrong number of scores -- the error text is the one the run records.
        KeyError: an unknown reward name; ValueError: invalid ``weight`` / ``timeout_s``.
    """
    from molt_core.rewards import reward_spec
    from molt_core.rollout.scoring import score_group

    if isinstance(reward, str):
        from molt_core.plugins import load_plugins

        name, reward = reward, load_plugins().get("rewards", reward)
    name = name or getattr(reward, "__name__", None) or type(reward).__name__
    single = isinstance(responses, str)
    resp: list[str] = [responses] if isinstance(responses, str) else list(responses)
    if tasks is None or isinstance(tasks, dict):
        task_list = [dict(tasks or {}) for _ in resp]
    else:
        task_list = list(tasks)
        if len(task_list) != len(resp):
            raise ValueError(f"{len(resp)} responses but {len(task_list)} tasks")
    spec = reward_spec(name, reward, {**(table or {}), **options})
    items = [_rollout_stub(r, t, tokenizer) for r, t in zip(resp, task_list)]

    async def go() -> list[Trajectory]:
        return await score_group([spec], items, asyncio.Semaphore(16))

    out = asyncio.run(go())
    scores = []
    for t in out:
        if t.status != "ok":
            raise RewardCallFailed(t.error or "failed")
        scores.append(t.info["rewards"][name])
    return scores[0] if single else scores
