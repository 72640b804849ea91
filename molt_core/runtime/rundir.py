"""The run directory: ``config.toml``, ``metrics.jsonl`` (one row per step, also handed to
every logger plugin), ``trajectories.jsonl`` (a sample) and ``reward.png``."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from molt_core.config import RunConfig, text_hint
from molt_core.plugins import PluginHost
from molt_core.types import Trajectory

__all__ = ["RunLog", "check_loggers", "decode_turns", "draw_reward_plot", "sample_row"]

METRICS_FILE = "metrics.jsonl"
"""The metrics file :class:`RunLog` always writes (the ``jsonl`` logger's default file name)."""


def check_loggers(cfg: RunConfig, host: PluginHost) -> dict[str, type]:
    """Check every ``[loggers.NAME]`` table before any compute: a registered logger, and options valid
    against its ``Options`` Pydantic model if any.

    Returns:
        ``{name: logger class}`` in recipe order.

    Raises:
        ValueError: ``loggers.NAME: no logger named ...``, or each bad option as ``loggers.NAME.KEY: problem``.
    """
    import difflib

    from pydantic import BaseModel, ValidationError

    out: dict[str, type] = {}
    for name, options in cfg.loggers.items():
        try:
            cls = host.get("loggers", name)
        except KeyError as e:
            raise ValueError(f"loggers.{name}: {e.args[0]}") from None
        model = getattr(cls, "Options", None)
        if isinstance(model, type) and issubclass(model, BaseModel):
            try:
                model.model_validate(options)
            except ValidationError as e:
                bad = []
                for err in e.errors():
                    where = f"loggers.{name}.{'.'.join(map(str, err['loc']))}"
                    if err["type"] == "extra_forbidden":
                        known = list(model.model_fields)
                        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
                        hint = f"did you mean {close[0]!r}? " if close else ""
                        bad.append(f"{where}: unknown option ({hint}options of {name}: {', '.join(known)})")
                    else:
                        bad.append(f"{where}: {err['msg']}{text_hint(where, err)}")
                raise ValueError("invalid logger options: " + "; ".join(bad)) from None
        out[name] = cls
    return out


def _finite_or_none(v: Any) -> Any:
    """``v`` with each non-finite float (numpy's too, nested in lists and dicts) as None."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_finite_or_none(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite_or_none(x) for k, x in v.items()}
    if hasattr(v, "dtype") and hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        x = v.item()
        return None if isinstance(x, float) and not math.isfinite(x) else x
    return v


def decode_turns(traj: Trajectory, tokenizer: Any) -> list[dict[str, Any]]:
    """The turns of ``traj`` as text, for display: a turn is one run of context tokens and the sampled run after it.

    Returns:
        One dict per turn: ``segment``, ``context`` and ``response`` (special tokens kept), ``versions``
        (``[min, max]`` of the response's tokens, or None).
    """
    turns: list[dict[str, Any]] = []
    for si, seg in enumerate(traj.segments):
        ctx: list[int] = []
        resp: list[int] = []
        vers: list[int] = []

        def flush() -> None:
            if ctx or resp:
                turns.append({"segment": si, "context": tokenizer.decode(ctx, skip_special_tokens=False),
                              "response": tokenizer.decode(resp, skip_special_tokens=False),
                              "versions": [min(vers), max(vers)] if vers else None})

        for tid, sampled, v in zip(seg.token_ids, seg.loss_mask, seg.versions):
            if not sampled and resp:  # a new context run closes the turn
                flush()
                ctx, resp, vers = [], [], []
            if sampled:
                resp.append(tid)
                if v is not None:
                    vers.append(v)
            else:
                ctx.append(tid)
        flush()
    return turns


def sample_row(traj: Trajectory, turns: list[dict[str, Any]]) -> dict[str, Any]:
    """A logger plugin's ``log_samples`` row: ``{"prompt", "completion", "reward" (NaN: unscored), "status"}``."""
    return {"prompt": turns[0]["context"] if turns else "", "completion": turns[-1]["response"] if turns else "",
            "reward": float(traj.reward) if traj.reward is not None else float("nan"), "status": str(traj.status)}


def draw_reward_plot(run_dir: Path, rows: list[dict]) -> Path | None:
    """Draw ``run_dir/reward.png`` (``reward/mean``, its 20-step moving average, ``eval/pass@1``) with matplotlib's
    object API, safe on a background thread. Returns the path, or None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover
        return None
    xs = [r["step"] for r in rows if r.get("reward/mean") is not None]
    ys = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    ev = [(r["step"], r["eval/pass@1"]) for r in rows if r.get("eval/pass@1") is not None]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if xs:
        ax.plot(xs, ys, color="tab:blue", alpha=0.35, label="reward/mean")
        w = 20
        ma = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, ma, color="tab:blue", label=f"reward ({w}-step avg)")
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], "o-", color="tab:orange", label="eval pass@1 (held-out)")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(run_dir.name)
    fig.tight_layout()
    out = run_dir / "reward.png"
    fig.savefig(out, dpi=100)
    return out


class RunLog:
    """A run's ``metrics.jsonl``, ``trajectories.jsonl`` and ``reward.png``, plus its logger plugins (each
    ``cls(run_dir, config, **options)``). On resume at ``resume_step``, later rows are dropped (redone).

    Raises:
        ValueError: an unknown logger, invalid options, or a missing optional package (``loggers.NAME: ...``).
    """

    def __init__(self, run_dir: Path, cfg: RunConfig, host: PluginHost, resume_step: int | None) -> None:
        self.run_dir = run_dir
        self.path = run_dir / METRICS_FILE
        self.rows: list[dict] = []
        self._plotter: Any = None  # a one-thread executor for plot_later, started on first use
        self._plotted_at = -math.inf  # time.monotonic() of the last background redraw's start
        self._plotting: Any = None  # the future of the last background redraw
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if resume_step is None or row.get("step", 0) <= resume_step:
                        self.rows.append(row)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        traj_path = run_dir / "trajectories.jsonl"
        if resume_step is not None and traj_path.exists():
            kept = [line for line in traj_path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            traj_path.write_text("".join(line + "\n" for line in kept))
        self.host = host
        self.loggers = []
        for name, cls in check_loggers(cfg, host).items():
            options = dict(cfg.loggers[name])
            if name == "jsonl" and options.get("filename", METRICS_FILE) == METRICS_FILE:
                continue  # written above, always; a jsonl logger with another filename writes a copy there
            try:
                self.loggers.append(cls(run_dir, cfg, **options))
            except ImportError as e:  # an optional package (wandb, mlflow, ...): the message names the extra
                raise ValueError(f"loggers.{name}: {e}") from e

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row (step + metrics; non-finite floats as ``null``, strict JSON) and forward it to the
        logger plugins and hooks."""
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        for lg in self.loggers:
            lg.log(step, metrics)
        self.host.on_step_end(step, metrics)

    def trajectories(self, step: int, trajs: list[Trajectory], tokenizer: Any = None) -> None:
        """Append ``trajs`` to ``trajectories.jsonl`` (with ``turns``, :func:`decode_turns`, given a tokenizer)
        and hand :func:`sample_row` rows to each logger plugin's ``log_samples`` when text was decoded."""
        samples: list[dict[str, Any]] = []
        with (self.run_dir / "trajectories.jsonl").open("a") as f:
            for t in trajs:
                row = {"step": step, **t.model_dump(mode="json")}
                if tokenizer is not None:
                    row["turns"] = decode_turns(t, tokenizer)
                    samples.append(sample_row(t, row["turns"]))
                f.write(json.dumps(_finite_or_none(row)) + "\n")
        if samples:
            for lg in self.loggers:
                if hasattr(lg, "log_samples"):
                    lg.log_samples(step, samples)

    def plot(self) -> Path | None:
        """Redraw ``reward.png`` now, after any background redraw; returns the path (None without matplotlib).

        Raises:
            Exception: whatever the drawing raised, here or in a background redraw."""
        self._wait_plot()
        return draw_reward_plot(self.run_dir, list(self.rows))

    def plot_later(self, min_interval_s: float = 0.0) -> bool:
        """Redraw ``reward.png`` on a background thread from the rows so far, unless one is running or
        started under ``min_interval_s`` ago; returns whether one started. Its error is raised by the next
        :meth:`plot` or :meth:`close`."""
        if self._plotting is not None and not self._plotting.done():
            return False
        if time.monotonic() - self._plotted_at < min_interval_s:
            return False
        self._wait_plot()  # re-raises the previous redraw's error, if any
        self._plotted_at = time.monotonic()
        import concurrent.futures

        if self._plotter is None:
            self._plotter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="molt-plot")
        self._plotting = self._plotter.submit(draw_reward_plot, self.run_dir, list(self.rows))
        return True

    def _wait_plot(self) -> None:
        fut, self._plotting = self._plotting, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Wait for a background redraw, then close logger plugins.

        Raises:
            Exception: whatever a background redraw raised (the loggers are closed first)."""
        try:
            for lg in self.loggers:
                lg.close()
        finally:
            if self._plotter is not None:
                self._plotter.shutdown(wait=True)
                self._plotter = None
            self._wait_plot()
