"""``molt eval``: a recipe's held-out eval split, pass@1 / pass@k, a JSON report.

The model is one of

* a checkpoint of a run (``runs/X/checkpoints/step_N``: checksums verified first), or a run
  directory (its newest intact checkpoint);
* a Hugging Face model directory, a Hub id, ``pkg:<module>`` or ``builtin:<name>``;
* an OpenAI-compatible base URL (``http(s)://...``, e.g. a ``molt serve`` session's
  ``openai_base_url`` or a vLLM server's ``/v1``): text only, see :class:`UrlWorker`.

For a model on disk, evaluation runs the very code ``molt run`` evaluates with:
:meth:`molt_core.runtime.workers.RolloutWorker.evaluate_tasks` on the recipe's first
``eval.n_problems`` eval tasks, each sample seeded by :func:`molt_core.rollout.evalstats.eval_seed`,
metrics by :func:`molt_core.rollout.evalstats.eval_metrics`. So on a run's checkpoint at step ``s``,
with that run's ``config.toml`` (the default) and ``--n`` equal to ``eval.k``, the report's
``eval/pass@1`` is the ``eval/pass@1`` the run logged at step ``s`` (compared in the report's
``logged`` entry when the checkpoint belongs to a run directory).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from molt_core.agents import AgentContext
from molt_core.config import RunConfig, TeacherSection
from molt_core.rollout.evalstats import eval_metrics
from molt_core.plugins import PluginHost, load_plugins
from molt_core.rollout.scoring import RewardRunner
from molt_core.agents import load_agent
from molt_core.runtime.workers import _EPISODE, RolloutWorker
from molt_core.types import Result, SamplingParams, Trajectory

__all__ = ["ModelRef", "UrlWorker", "default_report_path", "evaluate", "resolve_model", "run_config_of", "summary"]


class ModelRef(dict):
    """What ``--model`` named: ``kind`` (``checkpoint``, ``hf``, ``url``), ``path`` (the model
    path an engine loads, or the URL), and for a checkpoint ``checkpoint``, ``run_dir``,
    ``step`` and ``version``."""


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def _looks_like_path(spec: str) -> bool:
    """True when ``spec`` can only be a local path: absolute, ``./`` / ``../`` / ``~``, or more
    than one ``/`` (a Hub id is ``org/name``; ``builtin:`` / ``pkg:`` names have a colon)."""
    if ":" in spec.split("/", 1)[0]:
        return False
    return spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1


def resolve_model(spec: str) -> ModelRef:
    """Classify ``--model`` (see the module doc).

    Raises:
        FileNotFoundError: a run directory without an intact checkpoint, or a directory that
            is neither a checkpoint, a run directory nor a Hugging Face model directory.
        molt_core.train.checkpoint.CheckpointCorrupt: a checkpoint whose files fail their
            checksums (the message names the file).
    """
    from molt_core.train.checkpoint import CHECKPOINT_DIR, latest_intact_checkpoint, verify_checkpoint

    if _is_url(spec):
        return ModelRef(kind="url", path=spec.rstrip("/"))
    d = Path(spec)
    if not d.exists() and _looks_like_path(spec):  # not a Hub id (org/name): say so, not "give a RECIPE"
        near = sorted(p.name for p in d.parent.iterdir())[-6:] if d.parent.is_dir() else []
        raise FileNotFoundError(f"--model {spec}: no such file or directory"
                                + (f" ({d.parent} holds {', '.join(near)})" if near else ""))
    if not d.is_dir():
        return ModelRef(kind="hf", path=spec)  # builtin:, pkg:, a Hub id; the loader names bad ones
    if (d / CHECKPOINT_DIR).is_dir() and not (d / "state.json").is_file():
        ck, skipped = latest_intact_checkpoint(d)
        if ck is None:
            why = "; ".join(skipped) or "none written yet"
            raise FileNotFoundError(f"--model {spec}: no intact checkpoint in {d / CHECKPOINT_DIR} ({why})")
        d = ck
    if (d / "state.json").is_file():
        meta = verify_checkpoint(d)
        if not (d / "model" / "config.json").is_file():
            raise FileNotFoundError(f"--model {spec}: checkpoint {d} has no model/config.json")
        return ModelRef(kind="checkpoint", path=str((d / "model").resolve()), checkpoint=str(d.resolve()),
                        run_dir=str(d.resolve().parent.parent), step=int(meta["step"]), version=int(meta["version"]))
    if (d / "config.json").is_file():
        return ModelRef(kind="hf", path=str(d.resolve()))
    raise FileNotFoundError(f"--model {spec}: not a checkpoint (state.json), a run directory (checkpoints/) "
                            f"nor a Hugging Face model directory (config.json)")


def run_config_of(ref: ModelRef) -> Path | None:
    """The ``config.toml`` of the run a checkpoint belongs to, or None."""
    if ref.get("kind") != "checkpoint":
        return None
    p = Path(ref["run_dir"]) / "config.toml"
    return p if p.is_file() else None


def default_report_path(ref: ModelRef) -> Path:
    """Where ``molt eval`` writes its report without ``--out``: ``<run_dir>/eval/step_N.json``
    for a run's checkpoint (the checkpoint itself stays as written), else
    ``runs/eval-<UTC time>.json`` (beside ``molt run``'s own run directories)."""
    if ref.get("kind") == "checkpoint":
        return Path(ref["run_dir"]) / "eval" / f"{Path(ref['checkpoint']).name}.json"
    return Path("runs") / f"eval-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}.json"


def summary(report: dict[str, Any]) -> str:
    """The human summary of a report: pass@1, pass@k, the sizes, the run's logged pass@1 at
    that checkpoint (if any), and the notes."""
    m, k = report["metrics"], report["k"]
    text = (f"pass@1 {m['eval/pass@1']:.4f}  " + (f"pass@{k} {m[f'eval/pass@{k}']:.4f}  " if k != 1 else "")
            + f"({report['n_problems']} tasks x "
            f"{report['n']} samples, T={report['temperature']}, failed {int(m['eval/failed'])})")
    if report.get("logged"):
        text += f"\n  the run logged eval/pass@1 {report['logged']['eval/pass@1']:.4f} at step {report['model']['step']}"
    return text + "".join(f"\nnote: {x}" for x in report.get("notes", []))


def _logged(ref: ModelRef) -> dict[str, float] | None:
    """The ``eval/*`` metrics the run logged at the checkpoint's step (None if it logged none)."""
    if ref.get("kind") != "checkpoint":
        return None
    f = Path(ref["run_dir"]) / "metrics.jsonl"
    if not f.is_file():
        return None
    for line in f.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("step") == ref["step"] and "eval/pass@1" in row:
            return {k: v for k, v in row.items() if k.startswith("eval/")}
    return None


class _TextRecord:
    """The text-only stand-in of a ledger for :class:`UrlWorker`: keeps the chat ``history``
    and builds a token-less :class:`Trajectory`."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.history: list[dict[str, Any]] = []

    def trajectory(self, **kw: Any) -> Trajectory:
        return Trajectory(group_id=self.group_id, **kw)


class UrlWorker(RolloutWorker):
    """A :class:`RolloutWorker` whose model is an OpenAI-compatible server at ``base_url``
    (chat completions through the ``openai`` SDK), for evaluation only.

    Text only: trajectories carry no token ids, so token identity
    (``invariants/tokens_retokenized``) and logprob checks do not apply; the server's own
    sampler and chat template decide the samples, so numbers match a run's only as far as
    that server matches the run's engine. Env agents send each turn's messages with the
    eval sampling settings (``temperature``, ``top_p``, ``max_tokens``, ``seed``; ``top_k`` as
    an extra body field, which vLLM and ``molt serve`` read); a ChatAgent gets ``base_url``
    and ``api_key`` in its context and talks to the server itself.

    Raises:
        ValueError: a recipe whose rewards ask the run's own engine as judge (no engine here).
    """

    token_exact = False

    def __init__(self, cfg: RunConfig, base_url: str, api_key: str | None = None, model_name: str | None = None) -> None:
        from openai import AsyncOpenAI

        self.cfg = cfg
        self.host = load_plugins(cfg.plugins)
        self.agent = load_agent(cfg, self.host)
        self.rewards = RewardRunner(cfg.rewards, lambda name: self.host.get("rewards", name),
                                    cfg.rollout.reward_concurrency, open_session=None)
        if self.rewards.wants_judge_session:
            raise ValueError("a reward of this recipe asks the run's own engine as judge; --model URL has no engine: "
                             "evaluate a checkpoint or model directory instead")
        self.teacher = None
        self.template_kwargs = dict(cfg.model.chat_template_kwargs)
        self.server = None
        self.inflight = 0
        self._stop_ids: list[int] = []
        self.base_url, self.api_key = base_url, api_key or "EMPTY"
        self.client = AsyncOpenAI(base_url=base_url, api_key=self.api_key, max_retries=0)
        self.model_name = model_name
        self.tokenizer = None

    async def _model(self) -> str:
        if self.model_name is None:  # the server's first model
            models = [m.id async for m in self.client.models.list()]
            if not models:
                raise ValueError(f"{self.base_url}/models lists no model; pass --served-model NAME")
            self.model_name = models[0]
        return self.model_name

    async def preflight(self) -> None:
        """Ask the server for its models once, so that a wrong URL or key fails the command
        with one message instead of failing every rollout.

        Raises:
            ValueError: the server cannot be reached, refuses the key, or lists no model.
        """
        import openai

        try:
            models = [m.id async for m in self.client.models.list()]
        except openai.APIError as e:
            raise ValueError(f"--model {self.base_url}: no OpenAI-compatible server answers there "
                             f"({type(e).__name__}: {e}); check the URL (it ends in /v1) and --api-key") from None
        if self.model_name is None:
            if not models:
                raise ValueError(f"{self.base_url}/models lists no model; pass --served-model NAME")
            self.model_name = models[0]

    def _ledger(self, group_id: str) -> _TextRecord:
        return _TextRecord(group_id)

    async def _env_turn(self, ledger: Any, messages: list[dict[str, Any]],
                        params: SamplingParams) -> tuple[str, list[dict[str, Any]]] | None:
        extra = {"top_k": params.top_k} if params.top_k > 0 else None
        resp = await self.client.chat.completions.create(
            model=await self._model(), messages=messages, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.max_tokens, seed=params.seed, extra_body=extra)
        action = resp.choices[0].message.content or ""
        ledger.history = [*messages, {"role": "assistant", "content": action}]
        seen = _EPISODE.get()
        if seen is not None:
            seen["messages"] = ledger.history
        return action, ledger.history

    async def _chat_episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, str]:
        ctx = AgentContext(task=task, openai_base_url=self.base_url, anthropic_base_url="", api_key=self.api_key,
                           sampling=params, model=await self._model())
        res = await self.agent.run(ctx)  # type: ignore[union-attr]
        if not isinstance(res, Result):
            raise TypeError(f"{type(self.agent).__name__}.run returned {type(res).__name__}; return a molt_core.types.Result")
        traj = Trajectory(group_id=group_id, task=task, reward=res.reward, score=res.score, info=res.info,
                          truncated=res.truncated)
        return traj, ""


def evaluate(cfg: RunConfig, host: PluginHost, model: str, *, n: int | None = None, k: int | None = None,
             out: str | Path | None = None, recipe: str = "", api_key: str | None = None,
             served_model: str | None = None) -> dict[str, Any]:
    """Evaluate ``model`` on ``cfg``'s first ``eval.n_problems`` eval tasks, ``n`` samples each
    (default ``eval.k``) at ``eval.temperature``, and write the report to ``out`` (if given).

    Returns:
        The report: ``metrics`` (``eval/pass@1``, ``eval/pass@<k>`` with ``k`` default ``n``,
        ``eval/reward``, ``eval/failed``), ``model`` (what was evaluated: kind, path,
        checkpoint step/version), ``recipe``, ``n``, ``k``, ``temperature``, ``seed``,
        ``n_problems``, ``tasks`` (per task: index, task, n, correct, rewards, failed,
        errors), ``logged`` (the run's own ``eval/*`` at that step, for a checkpoint; else
        None), ``notes``, ``time`` (UTC ISO 8601) and ``elapsed_s``.

    Raises:
        ValueError: ``k > n``, bad agent configuration, a URL with judge rewards.
        FileNotFoundError / CheckpointCorrupt: see :func:`resolve_model`.
    """
    n = cfg.eval.k if n is None else int(n)
    k = n if k is None else int(k)
    if not 1 <= k <= n:
        raise ValueError(f"--k {k}: pass@k needs 1 <= k <= n (--n {n} samples per task)")
    ref = resolve_model(model)
    t0 = time.perf_counter()
    agent = load_agent(cfg, host)
    tasks = list(itertools.islice(agent.tasks("eval", cfg.run.seed), cfg.eval.n_problems))
    if not tasks:
        raise ValueError("the recipe's agent has no eval tasks (eval.n_problems = 0 or an empty eval split)")
    cfg = cfg.model_copy(update={"teacher": TeacherSection()})  # annotations play no part in eval
    notes: list[str] = []
    if ref["kind"] == "url":
        worker: RolloutWorker = UrlWorker(cfg, ref["path"], api_key=api_key, model_name=served_model)
        notes.append("text-only evaluation over an OpenAI-compatible server: no token ids, so token identity "
                     "(invariants/tokens_retokenized) and logprob checks do not apply; samples come from the "
                     "server's sampler and chat template")
    else:
        worker = RolloutWorker(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": ref["path"]})}), 0)
    async def run() -> list[dict[str, Any]]:
        if isinstance(worker, UrlWorker):
            await worker.preflight()
        return await worker.evaluate_tasks(tasks, n, cfg.eval.temperature)

    try:
        results = asyncio.run(run())
    finally:
        _close(worker)
    report = {
        "metrics": eval_metrics(results, k), "model": dict(ref), "recipe": recipe, "n": n, "k": k,
        "temperature": cfg.eval.temperature, "seed": cfg.run.seed, "n_problems": len(tasks),
        "logged": _logged(ref), "notes": notes, "tasks": results,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "elapsed_s": time.perf_counter() - t0,
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1, default=str))
    return report


def _close(worker: RolloutWorker) -> None:
    """Stop what a worker started (its loopback server, its engine)."""
    if getattr(worker, "server", None) is not None:
        worker.server.stop()
    close = getattr(getattr(worker, "engine", None), "close", None)
    if close:
        close()
