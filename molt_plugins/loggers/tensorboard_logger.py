"""``tensorboard`` logger: scalars to TensorBoard event files (imports ``tensorboard`` only
when enabled; install with ``pip install molt-sdk[tensorboard]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from molt_plugins.loggers.samples import markdown_table

__all__ = ["TensorBoardLogger", "TensorBoardOptions"]


class TensorBoardOptions(BaseModel):
    """``subdir`` -- event-file directory inside the run dir; ``flush_secs`` -- writer flush
    period in seconds."""

    model_config = ConfigDict(extra="forbid")

    subdir: str = "tensorboard"
    flush_secs: int = Field(10, ge=1)


class TensorBoardLogger:
    """Writes each numeric metric as a scalar at ``global_step = step`` through
    ``torch.utils.tensorboard.SummaryWriter`` (non-numeric values are skipped), and samples of
    decoded rollouts as a Markdown text table.

    Raises:
        ImportError: ``tensorboard`` is not installed (the message says how to install it).
        ValueError: invalid options.
    """

    Options = TensorBoardOptions
    molt_requires = ("tensorboard",)
    """Optional modules it imports (``molt plugins`` names the extra when one is missing)."""

    def __init__(self, run_dir: str | Path, config: Any = None, **options: Any) -> None:
        from molt_plugins.rewards.base import validate_options

        self.options: TensorBoardOptions = validate_options(TensorBoardOptions, options, "loggers.tensorboard")  # type: ignore[assignment]
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "the tensorboard logger needs the `tensorboard` package: pip install 'molt-sdk[tensorboard]'"
            ) from e
        self.log_dir = Path(run_dir) / self.options.subdir
        self._w = SummaryWriter(log_dir=str(self.log_dir), flush_secs=self.options.flush_secs)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Add every numeric ``metrics`` value as scalar ``key`` at ``step``."""
        for k, v in metrics.items():
            if hasattr(v, "item") and callable(v.item):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            self._w.add_scalar(k, float(v), global_step=int(step))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Add decoded rollouts as text ``samples`` at ``step``: one Markdown table
        (``| prompt | completion | reward | status |``, :func:`~molt_plugins.loggers.samples.markdown_table`)
        shown in TensorBoard's text tab.

        Raises:
            ValueError: a malformed row (names its index and key).
        """
        self._w.add_text("samples", markdown_table(rows), global_step=int(step))

    def close(self) -> None:
        """Flush and close the event file."""
        self._w.close()
