"""Progress of a counted loop on the console: a rich bar with rate and ETA on a terminal,
a few plain lines (no ANSI codes) when the output is redirected."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.text import Text

__all__ = ["step_progress"]


class _RateColumn(ProgressColumn):
    """``12.3 steps/s`` (rich's own speed estimate over the recent updates), ``-`` before any."""

    def render(self, task: Task) -> Text:
        return Text("-" if task.speed is None else f"{task.speed:.1f} steps/s")


@contextmanager
def step_progress(console: Console, label: str, total: int, lines: int = 10) -> Iterator[Callable[[int, str], None]]:
    """Show the progress of ``total`` steps; yields ``update(done, info)`` (steps done; a text, e.g. the loss).

    On a terminal: a rich bar with done/total, rate, elapsed time and ETA. Otherwise at most
    ``lines`` plain lines ``"<label>: <done>/<total> <info> (<rate> steps/s, ETA <s> s)"``, one per
    ``total / lines`` steps and one at the end.
    """
    if console.is_terminal:
        cols = [TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), _RateColumn(),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
        with Progress(*cols, console=console, transient=False) as progress:
            task = progress.add_task(label, total=total, info="")

            def update(done: int, info: str = "") -> None:
                progress.update(task, completed=done, info=info)

            yield update
        return
    every = max(1, -(-total // max(1, lines)))
    t0 = time.perf_counter()
    shown = 0

    def plain(done: int, info: str = "") -> None:
        nonlocal shown
        if done == shown or (done < total and done - shown < every):
            return
        shown = done
        dt = time.perf_counter() - t0
        rate = done / dt if dt > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        console.print(f"{label}: {done}/{total} {info} ({rate:.1f} steps/s, ETA {eta:.0f} s)",
                      markup=False, highlight=False)

    yield plain
