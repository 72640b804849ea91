"""The run's stream of training tasks: an agent's ``train`` split, epoch after epoch
(:class:`TaskStream`), and the pre-flight check that the split can feed the run
(:func:`check_train_split`). Notes: docs/architecture.md.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

__all__ = ["TaskStream", "SplitExhausted", "check_train_split"]


class SplitExhausted(RuntimeError):
    """A train split that must not repeat has fewer tasks than the run needs."""


def _label(agent: Any, name: str | None) -> str:
    return repr(name) if name else type(agent).__name__


def check_train_split(agent: Any, seed: int, needed: int, name: str | None = None) -> None:
    """Fail before compute when the train split is empty, or, for an agent with ``repeat_train_split = False``,
    holds fewer than ``needed`` tasks (``run.steps x rollout.prompts_per_step``).

    Raises:
        ValueError: the split is empty.
        SplitExhausted: a non-repeating split holds fewer than ``needed`` tasks.
    """
    label = _label(agent, name)
    first = next(iter(agent.tasks("train", seed)), None)
    if first is None:
        raise ValueError(f"agent {label}: its 'train' split yields no task (tasks('train', {seed}) is empty); "
                         f"give the agent training data")
    if getattr(agent, "repeat_train_split", True):
        return
    have = sum(1 for _ in itertools.islice(agent.tasks("train", seed), needed))
    if have < needed:
        raise SplitExhausted(f"agent {label}: its 'train' split has {have} tasks and must not repeat "
                             f"(repeat_train_split = False), but the run needs {needed} (run.steps x "
                             f"rollout.prompts_per_step); lower run.steps or rollout.prompts_per_step, or allow epochs")


class TaskStream:
    """Endless iteration over an agent's ``train`` split: each epoch calls ``tasks("train", seed)`` again.

    Args:
        agent, seed: an object with ``tasks(split, seed)`` and the run seed passed to it.
        start: tasks already drawn (a resumed run's cursor); they are skipped.
        name: the agent's name for error messages (default: its class name).

    Attributes:
        drawn: tasks drawn since the start of the run (the resumable cursor).
        epoch: 0-based epoch of the last task drawn.
        epoch_size: tasks in one epoch, once a first epoch has ended (else None).
    """

    def __init__(self, agent: Any, seed: int, start: int = 0, name: str | None = None) -> None:
        self.agent, self.seed, self.name = agent, seed, name
        self.drawn = 0
        self.epoch = 0
        self.epoch_size: int | None = None
        self._in_epoch = 0
        self._it: Iterator[dict[str, Any]] = iter(agent.tasks("train", seed))
        for _ in range(start):
            self.next()

    def next(self) -> dict[str, Any]:
        """The next task, starting a new epoch when the split runs out.

        Raises:
            ValueError: the split yields no task at all.
            SplitExhausted: the split ran out and the agent forbids repeating it.
        """
        try:
            task = next(self._it)
        except StopIteration:
            label = _label(self.agent, self.name)
            if self._in_epoch == 0:
                raise ValueError(f"agent {label}: its 'train' split yields no task; give the agent training data") from None
            if not getattr(self.agent, "repeat_train_split", True):
                raise SplitExhausted(f"agent {label}: its 'train' split has {self._in_epoch} tasks and must not repeat "
                                     f"(repeat_train_split = False), but the run asked for task {self.drawn + 1}; "
                                     f"lower run.steps or rollout.prompts_per_step") from None
            self.epoch_size = self._in_epoch
            self.epoch += 1
            self._in_epoch = 0
            self._it = iter(self.agent.tasks("train", self.seed))
            try:
                task = next(self._it)
            except StopIteration:
                raise ValueError(f"agent {label}: its 'train' split yielded no task in epoch {self.epoch}") from None
        self._in_epoch += 1
        self.drawn += 1
        return task

    def take(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` tasks (possibly spanning an epoch boundary)."""
        return [self.next() for _ in range(n)]
