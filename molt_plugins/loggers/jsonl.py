"""``jsonl`` logger: one JSON object per step in ``<run_dir>/metrics.jsonl`` (always on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["JsonlLogger", "JsonlOptions", "read_metrics"]


class JsonlOptions(BaseModel):
    """``filename`` -- file name inside the run directory."""

    model_config = ConfigDict(extra="forbid")

    filename: str = "metrics.jsonl"


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):  # 0-d tensors / numpy scalars
        v = v.item()
    return v


class JsonlLogger:
    """Appends ``{"step": step, **metrics}`` as one line per :meth:`log` call, flushed at once
    (a killed run keeps every logged step). Non-finite floats are written as JSON ``NaN`` /
    ``Infinity`` (Python's ``json`` reads them back).

    Args:
        run_dir: the run directory (created if missing).
        config: the run's ``RunConfig`` (unused; part of the logger interface).
        **options: :class:`JsonlOptions` fields.

    Raises:
        ValueError: invalid options (names the field).
    """

    Options = JsonlOptions

    def __init__(self, run_dir: str | Path, config: Any = None, **options: Any) -> None:
        from molt_plugins.rewards.base import validate_options

        self.options: JsonlOptions = validate_options(JsonlOptions, options, "loggers.jsonl")  # type: ignore[assignment]
        self.path = Path(run_dir) / self.options.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Write one line ``{"step": step, **metrics}``.

        Raises:
            ValueError: the logger is closed, or ``metrics`` has a key ``"step"`` that disagrees.
        """
        if self._f.closed:
            raise ValueError(f"JsonlLogger for {self.path} is closed")
        row = {"step": int(step)}
        for k, v in metrics.items():
            v = _plain(v)
            if k == "step" and v != step:
                raise ValueError(f"metrics['step'] = {v} disagrees with step = {step}")
            row[k] = v
        self._f.write(json.dumps(row, allow_nan=True) + "\n")
        self._f.flush()

    def rewind(self, step: int) -> int:
        """Drop lines whose ``step`` is greater than ``step`` (resuming from a checkpoint taken
        at ``step``, so the curve continues without duplicates). Returns the lines dropped."""
        self._f.close()
        rows = read_metrics(self.path) if self.path.exists() else []
        keep = [r for r in rows if r.get("step", -1) <= step]
        with open(self.path, "w", encoding="utf-8") as f:
            for r in keep:
                f.write(json.dumps(r, allow_nan=True) + "\n")
        self._f = open(self.path, "a", encoding="utf-8")
        return len(rows) - len(keep)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._f.closed:
            self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl`` (skips a torn last line of a killed run)."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


