"""First-party metric loggers (``molt_register_loggers``).

Interface: ``cls(run_dir: Path, config: RunConfig, **options)`` with
``log(step: int, metrics: dict[str, float])`` and ``close()``; ``cls.Options`` is the
options model. ``jsonl`` is always on (``metrics.jsonl``); ``tensorboard`` and ``wandb``
import their packages only when a recipe enables them (``loggers = ["tensorboard"]``).
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_loggers(register):
    """Register ``jsonl``, ``tensorboard`` and ``wandb``."""
    from molt_plugins.loggers.jsonl import JsonlLogger
    from molt_plugins.loggers.tensorboard_logger import TensorBoardLogger
    from molt_plugins.loggers.wandb_logger import WandbLogger

    register("jsonl", JsonlLogger)
    register("tensorboard", TensorBoardLogger)
    register("wandb", WandbLogger)
