"""Sample tables shared by the loggers' ``log_samples(step, rows)``: a row is one decoded
rollout ``{"prompt": str, "completion": str, "reward": float, "status": str}``."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SAMPLE_COLUMNS", "sample_table", "markdown_table"]

SAMPLE_COLUMNS: tuple[str, ...] = ("prompt", "completion", "reward", "status")
"""The columns of a sample row, in table order."""


def sample_table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """``rows`` as lists in :data:`SAMPLE_COLUMNS` order: ``[prompt, completion, reward, status]``
    with ``reward`` a float (``None`` for a missing or non-finite reward, e.g. a failed rollout).

    Raises:
        ValueError: a row that is not a dict or lacks a column (names the row index and the key),
            or a reward that is not a number.
    """
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"samples[{i}]: expected a dict with keys {', '.join(SAMPLE_COLUMNS)}, got {type(row).__name__}")
        missing = [k for k in SAMPLE_COLUMNS if k not in row]
        if missing:
            raise ValueError(f"samples[{i}]: missing key(s) {', '.join(missing)} (a row has {', '.join(SAMPLE_COLUMNS)})")
        r = row["reward"]
        if hasattr(r, "item") and callable(r.item):  # 0-d tensors / numpy scalars
            r = r.item()
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float))):
            raise ValueError(f"samples[{i}].reward: expected a number or None, got {type(r).__name__} {r!r}")
        r = None if r is None or not math.isfinite(r) else float(r)
        out.append([str(row["prompt"]), str(row["completion"]), r, str(row["status"])])
    return out


def _cell(v: Any) -> str:
    """One Markdown table cell: ``|`` escaped, line breaks as ``<br>``, a float as ``%.4g``."""
    if v is None:
        return ""
    if isinstance(v, float):
        return format(v, ".4g")
    return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace("\n", "<br>")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a Markdown table (header ``| prompt | completion | reward | status |``), the
    form TensorBoard's text tab renders.

    Raises:
        ValueError: as :func:`sample_table`.
    """
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in sample_table(rows)]
    return "\n".join(lines)
