"""``mlflow`` logger: MLflow tracking, to a local SQLite store in the run directory by default
(``sqlite:///<run_dir>/mlflow.db``, artifacts in ``<run_dir>/mlartifacts``; no server needed;
MLflow 3 refuses the older ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``). Imports
``mlflow`` only when enabled; install with ``pip install 'molt-sdk[mlflow]'``.

Browse a local store with ``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``. The logger talks
to MLflow through one ``MlflowClient`` (no global active run), so several runs in one process
never share state.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from molt_plugins.loggers.samples import SAMPLE_COLUMNS, sample_table

__all__ = ["MlflowLogger", "MlflowOptions", "mlflow_key", "flat_params"]

PARAM_VALUE_MAX = 500
"""Longest param value sent (characters): the limit of older MLflow servers (newer ones allow 6000)."""
BATCH_PARAMS, BATCH_METRICS = 100, 1000
"""MLflow's ``log_batch`` limits per call (params, metrics)."""


class MlflowOptions(BaseModel):
    """``tracking_uri`` -- where runs go (default ``sqlite:///<run_dir>/mlflow.db`` with artifacts
    in ``<run_dir>/mlartifacts``; e.g. ``http://mlflow.example:5000``); ``experiment`` -- experiment name (default: the run
    name; created when missing); ``run_name`` (default: the run name); ``tags`` -- run tags;
    ``log_config`` -- log the resolved config as run params (``section.key``)."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = None
    experiment: str | None = None
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    log_config: bool = True


def mlflow_key(key: str) -> str:
    """``key`` as a valid MLflow metric/param name (letters, digits, ``_ - . / :`` and spaces):
    ``@`` becomes ``_at_`` (``eval/pass@1`` -> ``eval/pass_at_1``), any other character ``_``."""
    return re.sub(r"[^\w\-./ :]", "_", key.replace("@", "_at_"))


def flat_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested ``data`` as ``{"section.key": text}``: dicts recurse, other values as JSON text
    (strings as they are), cut to :data:`PARAM_VALUE_MAX` characters; an empty dict is skipped."""
    out: dict[str, str] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_params(v, key + "."))
            continue
        text = v if isinstance(v, str) else json.dumps(v)
        out[mlflow_key(key)] = text if len(text) <= PARAM_VALUE_MAX else text[: PARAM_VALUE_MAX - 3] + "..."
    return out


class MlflowLogger:
    """Logs each step's numeric metrics to one MLflow run (``log_batch``, at ``step``), the
    resolved config as params, and samples of decoded rollouts as a table artifact
    ``samples/step_<step>.json`` (``MlflowClient.log_table``; MLflow's UI shows it).

    Args:
        run_dir: the run directory; the default tracking URI is ``sqlite:///<run_dir>/mlflow.db``.
        config: the run's ``RunConfig`` (its ``run.name`` names experiment and run by default).
        **options: :class:`MlflowOptions` fields.

    Raises:
        ImportError: ``mlflow`` is not installed (the message names the ``molt-sdk[mlflow]`` extra).
        ValueError: invalid options (names ``loggers.mlflow.<field>``).
    """

    Options = MlflowOptions
    molt_requires = ("mlflow",)
    """Optional modules it imports (``molt plugins`` names the extra when one is missing)."""

    def __init__(self, run_dir: str | Path, config: Any = None, **options: Any) -> None:
        from molt_plugins.rewards.base import validate_options

        self.options: MlflowOptions = validate_options(MlflowOptions, options, "loggers.mlflow")  # type: ignore[assignment]
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("the mlflow logger needs the `mlflow` package: pip install 'molt-sdk[mlflow]'") from e
        self._Metric, self._Param = Metric, Param
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = getattr(getattr(config, "run", None), "name", None) or "molt"
        local = self.options.tracking_uri is None
        self.tracking_uri = self.options.tracking_uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self.options.experiment or name
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            exp_id = found.experiment_id
        elif local:  # artifacts beside the store, not in the working directory
            exp_id = self.client.create_experiment(
                experiment, artifact_location=(self.run_dir / "mlartifacts").resolve().as_uri())
        else:
            exp_id = self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=self.options.run_name or name, tags=dict(self.options.tags))
        self.run_id: str = run.info.run_id
        self._closed = False
        if self.options.log_config and hasattr(config, "model_dump"):
            params = [Param(k, v) for k, v in flat_params(config.model_dump(mode="json", by_alias=True)).items()]
            for i in range(0, len(params), BATCH_PARAMS):
                self.client.log_batch(self.run_id, params=params[i:i + BATCH_PARAMS])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Log every numeric value of ``metrics`` at ``step`` (keys through :func:`mlflow_key`;
        booleans, strings and ``None`` are skipped)."""
        now = int(time.time() * 1000)
        batch = []
        for k, v in metrics.items():
            if hasattr(v, "item") and callable(v.item):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            batch.append(self._Metric(mlflow_key(k), float(v), now, int(step)))
        for i in range(0, len(batch), BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=batch[i:i + BATCH_METRICS])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Log decoded rollouts as the table artifact ``samples/step_<step, 6 digits>.json``
        with columns ``step, prompt, completion, reward, status``.

        Raises:
            ValueError: a malformed row (names its index and key).
        """
        table = sample_table(rows)
        data: dict[str, list[Any]] = {"step": [int(step)] * len(table)}
        for j, col in enumerate(SAMPLE_COLUMNS):
            data[col] = [r[j] for r in table]
        self.client.log_table(self.run_id, data=data, artifact_file=f"samples/step_{int(step):06d}.json")

    def close(self) -> None:
        """Mark the run ``FINISHED`` (idempotent)."""
        if not self._closed:
            self._closed = True
            self.client.set_terminated(self.run_id, status="FINISHED")
