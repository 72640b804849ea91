"""``wandb`` logger: Weights & Biases, offline by default (no account needed; imports
``wandb`` only when enabled; install with ``pip install molt-sdk[wandb]``).

An offline run is written under ``<run_dir>/wandb/offline-run-*``; upload it later with
``wandb sync <that dir>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from molt_plugins.loggers.samples import SAMPLE_COLUMNS, sample_table

__all__ = ["WandbLogger", "WandbOptions"]


class WandbOptions(BaseModel):
    """``mode`` -- ``offline`` (default; nothing leaves the machine), ``online`` (needs
    ``WANDB_API_KEY``) or ``disabled``; ``project`` (default: the run name), ``entity``,
    ``name`` (default: the run name), ``tags``, ``group`` (runs compared together, e.g. seeds)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
    group: str | None = None


class WandbLogger:
    """Logs each step's metrics with ``run.log(metrics, step=step)`` and samples of decoded
    rollouts as a ``wandb.Table``; the resolved run config is the W&B run config.

    Raises:
        ImportError: ``wandb`` is not installed (the message says how to install it).
        ValueError: invalid options.
    """

    Options = WandbOptions
    molt_requires = ("wandb",)
    """Optional modules it imports (``molt plugins`` names the extra when one is missing)."""

    def __init__(self, run_dir: str | Path, config: Any = None, **options: Any) -> None:
        from molt_plugins.rewards.base import validate_options

        self.options: WandbOptions = validate_options(WandbOptions, options, "loggers.wandb")  # type: ignore[assignment]
        try:
            import wandb
        except ImportError as e:
            raise ImportError("the wandb logger needs the `wandb` package: pip install 'molt-sdk[wandb]'") from e
        cfg = config.model_dump(mode="json", by_alias=True) if hasattr(config, "model_dump") else (config or {})
        run_name = getattr(getattr(config, "run", None), "name", None)
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            mode=self.options.mode, dir=str(self.dir), project=self.options.project or run_name or "molt",
            entity=self.options.entity, name=self.options.name or run_name, tags=self.options.tags or None,
            group=self.options.group,
            config=cfg, reinit="create_new", settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """``run.log(metrics, step=step)`` (W&B requires non-decreasing steps)."""
        self._run.log({k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}, step=int(step))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log decoded rollouts as a ``wandb.Table`` under key ``samples`` at ``step``, columns
        ``step, prompt, completion, reward, status`` (:mod:`molt_plugins.loggers.samples`).

        Raises:
            ValueError: a malformed row (names its index and key).
        """
        import wandb

        data = [[int(step), *r] for r in sample_table(rows)]
        self._run.log({"samples": wandb.Table(columns=["step", *SAMPLE_COLUMNS], data=data)}, step=int(step))

    def close(self) -> None:
        """Finish the run (writes the offline run file)."""
        self._run.finish()
