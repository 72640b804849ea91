"""``wandb`` logger: Weights & Biases, offline by default (no account needed; imports
``wandb`` only when enabled; install with ``pip install molt-sdk[wandb]``).

An offline run is written under ``<run_dir>/wandb/offline-run-*``; upload it later with
``wandb sync <that dir>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["WandbLogger", "WandbOptions"]


class WandbOptions(BaseModel):
    """``mode`` -- ``offline`` (default; nothing leaves the machine), ``online`` (needs
    ``WANDB_API_KEY``) or ``disabled``; ``project`` (default: the run name), ``entity``,
    ``name``, ``tags``."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)


class WandbLogger:
    """Logs each step's metrics with ``run.log(metrics, step=step)``; the resolved run config
    is the W&B run config.

    Raises:
        ImportError: ``wandb`` is not installed (the message says how to install it).
        ValueError: invalid options.
    """

    Options = WandbOptions

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
            config=cfg, reinit="create_new", settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """``run.log(metrics, step=step)`` (W&B requires non-decreasing steps)."""
        self._run.log({k: (v.item() if hasattr(v, "item") else v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        """Finish the run (writes the offline run file)."""
        self._run.finish()
