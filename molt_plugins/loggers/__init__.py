"""First-party metric loggers (``molt_register_loggers``).

Interface: ``cls(run_dir: Path, config: RunConfig, **options)`` with
``log(step: int, metrics: dict[str, float])``, ``close()`` and, optionally,
``log_samples(step: int, rows: list[dict])`` (decoded rollouts; :mod:`molt_plugins.loggers.samples`);
``cls.Options`` is the options model, fed from the recipe's ``[loggers.NAME]`` table.
``jsonl`` is always on (``metrics.jsonl``); ``tensorboard``, ``wandb`` and ``mlflow`` import
their packages only when a recipe enables them (``loggers = ["tensorboard"]``).
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl


@hookimpl
def molt_register_loggers(register):
    """Register ``jsonl``, ``tensorboard``, ``wandb`` and ``mlflow``."""
    from molt_plugins.loggers.jsonl import JsonlLogger
    from molt_plugins.loggers.mlflow_logger import MlflowLogger
    from molt_plugins.loggers.tensorboard_logger import TensorBoardLogger
    from molt_plugins.loggers.wandb_logger import WandbLogger

    register("jsonl", JsonlLogger)
    register("tensorboard", TensorBoardLogger)
    register("wandb", WandbLogger)
    register("mlflow", MlflowLogger)
