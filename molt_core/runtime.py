"""The main job on Ray: rollout workers, the trainer, the async loop, weight sync, checkpoints.

Data flow of one step (docs/README.md): tasks from the agent's ``train`` split -> rollout workers
(engine + ledger [+ loopback server for ChatAgents] + agent runner) -> version-stamped
:class:`~molt_core.types.Trajectory` objects -> reward plugins -> groups (failed rollouts
excluded, groups with < 2 usable rollouts dropped, optional dynamic filter) -> the trainer
(recompute, gate + IS correction, advantages, loss, optimizer step) -> weights published to
every engine as version v+1 -> checkpoint every N steps -> metrics to every logger.

Asynchrony: rollout runs up to ``async.max_staleness`` steps ahead of training (0 =
synchronous). The driver keeps at most ``(1 + max_staleness) * prompts_per_step`` groups in
flight, each with its own object ref, and each step trains on the first
``prompts_per_step`` groups to finish: the driver bounds how far ahead groups *start*
(in launch order, a group is at most ``max_staleness`` versions old when trained;
``async/start_lag_max``). A weight sync reaches engines between decode steps, so in-flight
generations continue under the new weights (partial rollout) and every token records the
version that sampled it; a slow group can therefore reach the trainer with tokens older than
the bound, and the trainer's gate -- which bounds the *oldest token* of each rollout -- drops
it, visibly (``invariants/staleness_max`` over every token, ``correction/gated_frac``).

Ray: ``molt run`` starts a local cluster unless ``--ray-address`` joins one. Rollout workers
and the trainer are Ray actors placed by their declared ``num_cpus`` / ``num_gpus``. With
several engines, groups go to the least-loaded worker and every request of a session stays
on the worker (and engine) that opened it (session affinity).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import math
import os
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any

from molt_core.agents import AgentContext, ChatAgent, Env, EpisodeState, make_agent
from molt_core.config import RunConfig
from molt_core.plugins import PluginHost, import_path, load_plugins
from molt_core.rewards import JudgeEndpoint, RewardRunner, Rollout, component_metrics, reward_spec
from molt_core.tasks import TaskStream, check_train_split
from molt_core.types import Group, Result, RewardFailed, SamplingParams, Trajectory, new_id

__all__ = ["load_agent", "check_rewards", "RolloutWorker", "TrainerWorker", "main_job", "pass_at_k", "assemble_batch"]


# --------------------------------------------------------------------------- agents


def load_agent(cfg: RunConfig, host: PluginHost) -> Env | ChatAgent:
    """Instantiate the run's agent: ``agent.path`` (a ``.py`` file) or ``agent.name`` (a
    registered env), with ``agent.options``.

    A file may define ``agent`` (an instance or factory) or exactly one ``Env`` /
    ``ChatAgent`` subclass.

    Raises:
        ValueError: neither or both of ``agent.name`` / ``agent.path`` set, an unknown name,
            a file defining no agent or several, or invalid options.
    """
    a = cfg.agent
    if bool(a.name) == bool(a.path):
        raise ValueError("set exactly one of agent.name (a registered env, see `molt plugins`) or agent.path (a .py file) / --agent")
    if a.name:
        try:
            obj = host.get("envs", a.name)
        except KeyError as e:
            raise ValueError(f"agent.name: {e.args[0]}") from None
        return make_agent(obj, a.options)
    if not Path(a.path).is_file():
        raise ValueError(f"agent.path: no such file {a.path!r}")
    mod = import_path(a.path, prefix="molt_agent")
    modname = mod.__name__
    if hasattr(mod, "agent"):
        obj = mod.agent
        if isinstance(obj, (Env, ChatAgent)):
            return obj
        return make_agent(obj, a.options)
    found = [v for v in vars(mod).values()
             if isinstance(v, type) and issubclass(v, (Env, ChatAgent)) and v not in (Env, ChatAgent)
             and v.__module__ == modname]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        raise ValueError(f"agent.path {a.path!r} must define `agent` or exactly one Env/ChatAgent subclass (found {names})")
    return make_agent(found[0], a.options)


class RunFailed(RuntimeError):
    """The run finished but trained nothing (every step was skipped)."""


def check_rewards(cfg: RunConfig, host: PluginHost) -> None:
    """Check every ``[rewards.<name>]`` table before any compute: the name is registered, the
    reserved keys ``weight`` / ``timeout_s`` are valid and, when the reward declares an
    ``Options`` Pydantic model, the remaining options validate.

    Raises:
        ValueError: naming ``rewards.<name>`` (unknown; lists registered names),
            ``rewards.<name>.weight`` / ``.timeout_s``, or ``rewards.<name>.<field>`` (invalid option).
    """
    from pydantic import BaseModel, ValidationError

    for name, table in cfg.rewards.items():
        try:
            fn = host.get("rewards", name)
        except KeyError as e:
            raise ValueError(f"rewards.{name}: {e.args[0]}") from None
        opts = reward_spec(name, fn, table).options  # reserved keys (weight, timeout_s) checked and split off
        model = getattr(fn, "Options", None)
        if isinstance(model, type) and issubclass(model, BaseModel):
            try:
                model.model_validate(opts)
            except ValidationError as e:
                bad = "; ".join(f"rewards.{name}.{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
                raise ValueError(f"invalid reward options: {bad}") from None


def _sampling(cfg: RunConfig, stop_token_ids: list[int], temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                          top_k=r.top_k, max_tokens=r.max_tokens, stop_token_ids=list(stop_token_ids))


def _success(t: Trajectory) -> float:
    """1.0 when a finished rollout solved its task (score, else reward, >= 1), else 0.0."""
    if t.status != "ok":
        return 0.0
    v = t.score if t.score is not None else t.reward
    return 1.0 if v is not None and v >= 1.0 - 1e-9 else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, arXiv 2107.03374, eq. 1). Raises: ValueError if k > n."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --------------------------------------------------------------------------- rollout worker

# what one episode opened, for rewards that want the whole rollout: set per episode task by
# RolloutWorker._episode, filled by _ledger (Env path) and _chat_episode (ChatAgent path)
_EPISODE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("molt_episode", default=None)


class RolloutWorker:
    """One engine with its agent runners; a Ray actor in ``molt run`` (usable in-process).

    Args:
        cfg: the run config (a ``RunConfig`` or its dict).
        index: worker index (seeds differ per worker).

    Raises:
        ValueError / PluginError: bad agent or engine config (raised in the constructor, i.e.
            before any rollout).
    """

    def __init__(self, cfg: RunConfig | dict, index: int = 0) -> None:
        import torch

        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        torch.set_num_threads(self.cfg.run.threads)
        self.host = load_plugins(self.cfg.plugins)
        self.agent = load_agent(self.cfg, self.host)
        factory = self.host.get("engines", self.cfg.engine.name)
        e = self.cfg.engine
        self.engine = factory(model=self.cfg.model.path, max_batch_size=e.max_batch_size, dtype=e.dtype,
                              gguf_file=self.cfg.model.gguf_file, model_seed=self.cfg.run.seed,
                              seed=self.cfg.run.seed * 1000 + index, **e.options)
        self.tokenizer = self.engine.tokenizer
        self.rewards = RewardRunner(self.cfg.rewards, lambda name: self.host.get("rewards", name),
                                    self.cfg.rollout.reward_concurrency, open_session=self._judge_session)
        self.teacher = None  # on-policy distillation: annotates ok trajectories with teacher logprobs
        if self.cfg.teacher.name:
            try:
                teacher_cls = self.host.get("teachers", self.cfg.teacher.name)
            except KeyError as e:
                raise ValueError(f"teacher.name: {e.args[0]}") from None
            self.teacher = teacher_cls(self.tokenizer, **self.cfg.teacher.options)
        self.template_kwargs = dict(self.cfg.model.chat_template_kwargs)
        self.server = None
        self.inflight = 0
        if self.rewards.wants_judge_session:
            self._server()  # judges asking the run's own engine get one loopback session per call
        from molt_core.ledger import Ledger

        self._stop_ids = Ledger(self.tokenizer, chat_template_kwargs=self.template_kwargs).stop_token_ids

    # -- episodes -------------------------------------------------------------------------
    def _server(self):
        """The worker's loopback server (started on first use)."""
        if self.server is None:
            from molt_core.server.app import start_server

            self.server = start_server(self.engine, self.tokenizer, chat_template_kwargs=self.template_kwargs)
        return self.server

    def _ledger(self, group_id: str):
        from molt_core.ledger import Ledger

        ledger = Ledger(self.tokenizer, group_id=group_id, chat_template_kwargs=self.template_kwargs)
        seen = _EPISODE.get()
        if seen is not None:  # rewards that want the whole rollout read its messages
            seen["ledgers"].append(ledger)
        return ledger

    def _judge_session(self) -> tuple[JudgeEndpoint, Any]:
        """A fresh loopback session for one judge call and its closer (the session's
        trajectory is dropped: judge calls are never trained on)."""
        sess = self._server().create_session(group_id="judge")
        return JudgeEndpoint(sess.openai_base_url, sess.api_key), lambda: self.server.close_session(sess.session_id)

    async def _env_episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, str]:
        env: Env = self.agent  # type: ignore[assignment]
        r = self.cfg.rollout
        ledger = self._ledger(group_id)
        messages: list[dict[str, Any]] = []
        sp = getattr(getattr(env, "options", None), "system_prompt", None) or env.system_prompt
        if sp:
            messages.append({"role": "system", "content": sp})
        messages.append({"role": "user", "content": env.reset(task)})
        state = EpisodeState(task=task)
        reward, score, truncated, info = 0.0, None, False, {}
        action = ""
        for turn in range(r.max_turns):
            prep = ledger.prepare(messages, params=params)
            room = r.max_total_tokens - len(prep.prompt_ids)
            if room <= 0:
                truncated = True
                break
            p = params.model_copy(update={"max_tokens": min(params.max_tokens, room)})
            out = await self.engine.generate(prep.prompt_ids, p)
            ledger.commit(prep, out, p)
            ids = out.token_ids[:-1] if (out.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in self._stop_ids) else out.token_ids
            action = self.tokenizer.decode(ids, skip_special_tokens=False)
            messages = ledger.history
            state.turn, state.messages = turn, messages
            res = await asyncio.to_thread(env.step, action, state)  # graders may block (sandbox, judge)
            reward += res.reward
            score = res.score if res.score is not None else score
            info.update(res.info)
            if res.sampling_params is not None:
                params = res.sampling_params.model_copy(update={"stop_token_ids": params.stop_token_ids})
            if res.terminated or res.truncated:
                truncated = truncated or res.truncated  # a length-cut turn: the ledger marks it
                break
            if res.observation is None:
                break
            messages = messages + [{"role": "user", "content": res.observation}]
        else:
            truncated = True
        traj = ledger.trajectory(reward=reward, score=score, info=info, task=task, truncated=truncated)
        return traj, action

    async def _chat_episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, str]:
        sess = self._server().create_session(group_id=group_id, chat_template_kwargs=self.template_kwargs)
        ctx = AgentContext(task=task, openai_base_url=sess.openai_base_url, anthropic_base_url=sess.anthropic_base_url,
                           api_key=sess.api_key, sampling=params)
        try:
            res = await self.agent.run(ctx)  # type: ignore[union-attr]
            messages = self.server.sessions.ledger(sess.session_id).history
        finally:
            traj = self.server.close_session(sess.session_id)
        hist = [m for m in messages if m.get("role") == "assistant"]
        action = str(hist[-1].get("content", "")) if hist else ""
        if not isinstance(res, Result):
            raise TypeError(f"{type(self.agent).__name__}.run returned {type(res).__name__}; return a molt_core.types.Result")
        # model_copy does not validate: score_group checks reward / score are finite numbers;
        # the ledger's truncation (a length-cut turn) and its own info keys stand whatever the agent says
        traj = traj.model_copy(update={"reward": res.reward, "score": res.score, "task": task,
                                       "truncated": traj.truncated or res.truncated, "info": {**res.info, **traj.info}})
        seen = _EPISODE.get()
        if seen is not None:
            seen["messages"] = messages
        return traj, action

    async def _episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, Rollout | None]:
        """Run the agent on ``task``: the unscored trajectory and its :class:`Rollout` (None
        when the rollout failed; a failure never raises)."""
        seen: dict[str, Any] = {"ledgers": [], "messages": None}
        _EPISODE.set(seen)  # this task's context: the episode's ledgers / chat messages land here
        try:
            run = self._env_episode if isinstance(self.agent, Env) else self._chat_episode
            traj, action = await asyncio.wait_for(run(task, group_id, params), self.cfg.rollout.timeout_s)
        except asyncio.TimeoutError:
            return Trajectory(group_id=group_id, task=task, status="failed", error=f"timeout after {self.cfg.rollout.timeout_s} s"), None
        except RewardFailed as e:
            return Trajectory(group_id=group_id, task=task, status="failed", error=f"reward failed: {e}"), None
        except Exception as e:  # the agent raised: that rollout fails, the run continues
            return Trajectory(group_id=group_id, task=task, status="failed", error=f"{type(e).__name__}: {e}"), None
        ledger = next((lg for lg in seen["ledgers"] if lg.rollout_id == traj.rollout_id), None)
        messages = seen["messages"] if seen["messages"] is not None else (ledger.history if ledger is not None else [])
        if not traj.segments or traj.num_sampled == 0:
            return traj.fail("the rollout sampled no token"), None
        return traj, Rollout(response=action, task=task, messages=messages, trajectory=traj)

    async def _group(self, task: dict, group_id: str, params: SamplingParams, n: int) -> list[Trajectory]:
        """``n`` rollouts of ``task``, scored together by the reward plugins
        (:func:`molt_core.rewards.score_group`), then annotated by the teacher if any."""
        items = await asyncio.gather(*(self._episode(task, group_id, params) for _ in range(n)))
        trajs = await self.rewards.score(list(items), agent_label=f"agent {type(self.agent).__name__}")
        if self.teacher is None:
            return trajs
        out = []
        for t in trajs:
            if t.status == "ok":
                try:  # a failing teacher marks the trajectory failed, like a failing reward
                    t = await asyncio.to_thread(self.teacher.annotate, t)
                except Exception as e:
                    t = t.fail(f"teacher {self.cfg.teacher.name} raised {type(e).__name__}: {e}")
            out.append(t)
        return out

    async def rollout(self, tasks: list[dict], n: int) -> list[Group]:
        """Run ``n`` rollouts of each task concurrently (the engine batches them); each
        group is scored as soon as its ``n`` rollouts finish.

        Returns:
            One :class:`Group` per task, trajectories in completion-independent order.
        """
        self.inflight += len(tasks) * n
        try:
            params = _sampling(self.cfg, self._stop_ids)
            groups = [Group(task=t) for t in tasks]
            scored = await asyncio.gather(*(self._group(g.task, g.group_id, params, n) for g in groups))
            for g, trajs in zip(groups, scored):
                g.trajectories = list(trajs)
            return groups
        finally:
            self.inflight -= len(tasks) * n

    async def rollout_each(self, tasks: list[dict], n: int) -> Group | tuple[Group, ...]:
        """:meth:`rollout` for a call with ``num_returns = len(tasks)``: one return value (so one
        object ref) per group -- the Group itself for a single task, else a tuple."""
        groups = await self.rollout(tasks, n)
        return groups[0] if len(groups) == 1 else tuple(groups)

    async def evaluate(self, tasks: list[dict], k: int, temperature: float) -> dict[str, float]:
        """Sample ``k`` rollouts per task at ``temperature`` (no training); returns
        ``eval/pass@1``, ``eval/pass@k`` (unbiased estimator), ``eval/reward`` and
        ``eval/failed``."""
        params = _sampling(self.cfg, self._stop_ids, temperature=temperature)
        per_task = await asyncio.gather(*(self._group(t, new_id("eval"), params, k) for t in tasks))
        trajs = [t for ts in per_task for t in ts]
        p1, pk, rewards, failed = [], [], [], 0
        for i in range(len(tasks)):
            ts = trajs[i * k:(i + 1) * k]
            c = int(sum(_success(t) for t in ts))
            p1.append(pass_at_k(k, c, 1))
            pk.append(pass_at_k(k, c, k))
            rewards += [t.reward for t in ts if t.status == "ok" and t.reward is not None]
            failed += sum(t.status != "ok" for t in ts)
        out = {"eval/pass@1": sum(p1) / max(1, len(p1)), f"eval/pass@{k}": sum(pk) / max(1, len(pk)),
               "eval/reward": sum(rewards) / max(1, len(rewards)), "eval/failed": float(failed)}
        return out

    async def load_weights(self, state: dict, version: int) -> int:
        """Hand new weights to the engine (applied between decode steps); returns ``version``."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.load_weights, state, version)
        return version

    def load(self) -> int:
        """Rollouts in flight on this worker (the router's load measure)."""
        return self.inflight

    def placement(self) -> dict[str, str]:
        """Where this worker runs: ``{"node_id", "hostname", "pid"}`` (Ray node id when in Ray)."""
        import socket

        node = ""
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
        except ImportError:  # pragma: no cover
            pass
        return {"node_id": node, "hostname": socket.gethostname(), "pid": str(os.getpid())}


# --------------------------------------------------------------------------- trainer actor


class TrainerWorker:
    """The single trainable actor wrapped for Ray (see :class:`molt_core.trainer.Trainer`)."""

    def __init__(self, cfg: RunConfig | dict) -> None:
        import torch

        from molt_core.trainer import Trainer

        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        torch.set_num_threads(self.cfg.run.threads)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
        self.trainer = Trainer(self.cfg)

    def sft(self) -> dict[str, float]:
        """Warm start: :func:`molt_core.sft.warm_start` -- the same computation as ``molt sft``
        (``sft.steps`` of supervised fine-tuning on the agent's train tasks, ``sft.label_noise``
        of the targets deliberately wrong, ``run.threads`` torch threads). Returns first/last loss."""
        from molt_core.sft import warm_start

        s = self.cfg.sft
        host = load_plugins(self.cfg.plugins)
        agent = load_agent(self.cfg, host)
        every = max(1, s.steps // 8)

        def progress(step: int, m: dict[str, float]) -> None:
            if (step + 1) % every == 0:
                print(f"SFT step {step + 1}/{s.steps}: loss {m['sft/loss']:.3f}", flush=True)

        losses = warm_start(self.trainer, agent, log=progress)
        return {"sft/loss_first": losses[0] if losses else float("nan"), "sft/loss_last": losses[-1] if losses else float("nan")}

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One optimizer step; returns the trainer's metrics and ``policy_version``."""
        m = self.trainer.train_step(trajectories)
        m["policy_version"] = float(self.trainer.version)
        return m

    def weights(self) -> tuple[dict, int]:
        """``(state_dict, version)`` to publish."""
        return {k: v.detach().clone() for k, v in self.trainer.weights().items()}, self.trainer.version

    def save(self, run_dir: str, cursor: dict) -> str:
        """Write a checkpoint (atomic, retention per ``checkpoint.keep``); returns its path."""
        return str(self.trainer.save_checkpoint(run_dir, cursor))

    def restore(self, path: str) -> dict:
        """Load a checkpoint; returns its data cursor."""
        return self.trainer.load_checkpoint(path)


# --------------------------------------------------------------------------- batch assembly


def assemble_batch(groups: list[Group], dynamic_filter: bool,
                   reward_names: list[str] | tuple[str, ...] = ()) -> tuple[list[Trajectory], dict[str, float]]:
    """Turn finished groups into the step's training trajectories.

    Failed rollouts are excluded (never scored 0); a group with fewer than 2 usable rollouts
    is dropped; with ``dynamic_filter`` a group whose rewards are all equal is dropped (its
    advantages would all be 0; DAPO, arXiv 2503.14476). Returns the trajectories and counts
    (``rollout/failed``, ``rollout/truncated``, ``rollout/groups_dropped``,
    ``rollout/groups_filtered``, ``reward/mean`` over usable rollouts) and, for each name in
    ``reward_names``, ``reward/NAME/mean`` and ``reward/NAME/failed``
    (:func:`molt_core.rewards.component_metrics`).
    """
    out: list[Trajectory] = []
    failed = truncated = dropped = filtered = 0
    rewards: list[float] = []
    for g in groups:
        failed += sum(t.status != "ok" for t in g.trajectories)
        truncated += sum(t.truncated for t in g.trajectories)
        usable = g.usable()
        rewards += [float(t.reward) for t in usable]  # type: ignore[arg-type]
        if len(usable) < 2:
            dropped += 1
            continue
        if dynamic_filter and len({t.reward for t in usable}) == 1:
            filtered += 1
            continue
        out += usable
    n = sum(len(g.trajectories) for g in groups)
    m = {"rollout/failed": float(failed), "rollout/truncated": float(truncated), "rollout/groups_dropped": float(dropped),
         "rollout/groups_filtered": float(filtered), "rollout/trajectories": float(n),
         "reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"),
         **component_metrics(groups, list(reward_names))}
    return out, m


# --------------------------------------------------------------------------- run directory


class RunLog:
    """``metrics.jsonl``, ``trajectories.jsonl`` (a sample) and ``reward.png`` of a run, plus
    logger plugins."""

    def __init__(self, run_dir: Path, cfg: RunConfig, host: PluginHost, resume_step: int | None) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if resume_step is None or row.get("step", 0) <= resume_step:
                        self.rows.append(row)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        self.host = host
        self.loggers = []
        for name in cfg.loggers:
            if name == "jsonl":
                continue
            self.loggers.append(host.get("loggers", name)(run_dir, cfg))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row (step + metrics) and forward it to logger plugins and hooks."""
        row = {"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for lg in self.loggers:
            lg.log(step, metrics)
        self.host.on_step_end(step, metrics)

    def trajectories(self, step: int, trajs: list[Trajectory], tokenizer: Any = None) -> None:
        """Append a sample of trajectories (JSON) to ``trajectories.jsonl``."""
        with (self.run_dir / "trajectories.jsonl").open("a") as f:
            for t in trajs:
                f.write(json.dumps({"step": step, **t.model_dump(mode="json")}) + "\n")

    def plot(self) -> Path | None:
        """Redraw ``reward.png``: mean reward per step (and 20-step moving average) and eval
        pass@1. Returns the path, or None when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # pragma: no cover
            return None
        xs = [r["step"] for r in self.rows if r.get("reward/mean") is not None]
        ys = [r["reward/mean"] for r in self.rows if r.get("reward/mean") is not None]
        ev = [(r["step"], r["eval/pass@1"]) for r in self.rows if r.get("eval/pass@1") is not None]
        fig, ax = plt.subplots(figsize=(7, 4))
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
        ax.set_title(self.run_dir.name)
        fig.tight_layout()
        out = self.run_dir / "reward.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out

    def close(self) -> None:
        """Close logger plugins."""
        for lg in self.loggers:
            lg.close()


# --------------------------------------------------------------------------- the main job


def _absolute(cfg: RunConfig) -> RunConfig:
    """Make file paths in the config absolute so Ray workers resolve them identically."""
    plugins = [str(Path(p).resolve()) if p.endswith(".py") else p for p in cfg.plugins]
    agent = cfg.agent
    if agent.path:
        agent = agent.model_copy(update={"path": str(Path(agent.path).resolve())})
    model = cfg.model
    if not model.path.startswith("builtin:") and Path(model.path).exists():
        model = model.model_copy(update={"path": str(Path(model.path).resolve())})
    teacher = cfg.teacher
    tpath = teacher.options.get("path")
    if isinstance(tpath, str) and not tpath.startswith("builtin:") and Path(tpath).exists():
        teacher = teacher.model_copy(update={"options": {**teacher.options, "path": str(Path(tpath).resolve())}})
    return cfg.model_copy(update={"plugins": plugins, "agent": agent, "model": model, "teacher": teacher})


def _init_ray(cfg: RunConfig, ray_address: str | None):
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if ray.is_initialized():
        return ray
    env = {"env_vars": {"OMP_NUM_THREADS": str(cfg.run.threads), "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}}
    if ray_address:
        ray.init(address=ray_address, runtime_env=env, log_to_driver=True, logging_level="warning")
    else:
        need = cfg.trainer.num_cpus + cfg.engine.num_cpus * cfg.engine.num_engines
        # address="local": always a fresh cluster, never a stale one left by `ray start`
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False, runtime_env=env,
                 log_to_driver=True, logging_level="warning")
    return ray


class _Local:
    """Stand-in for the slice of the Ray API ``main_job`` uses, running actors in this process:
    ``remote(cls).options(...).remote(*args)`` builds the object, ``actor.method.remote(...)``
    calls it at once (coroutines run on one private event loop), ``get`` unwraps. Used by
    ``molt run --local`` (debugging) and fast tests. Rollouts run when launched, so with
    ``async.max_staleness = k`` the queue still holds k steps of groups sampled ahead: every
    step after the first k trains on groups exactly k versions old (deterministic staleness)."""

    class _Ref:
        def __init__(self, value: Any) -> None:
            self.value = value

    class _Method:
        def __init__(self, owner: "_Local", fn: Any, num_returns: int = 1) -> None:
            self.owner, self.fn, self.num_returns = owner, fn, num_returns

        def options(self, num_returns: int = 1, **_: Any) -> "_Local._Method":
            return _Local._Method(self.owner, self.fn, num_returns)

        def remote(self, *args: Any, **kwargs: Any) -> Any:
            args = tuple(a.value if isinstance(a, _Local._Ref) else a for a in args)
            out = self.fn(*args, **kwargs)
            if asyncio.iscoroutine(out):
                out = self.owner.loop.run_until_complete(out)
            if self.num_returns > 1:
                return tuple(_Local._Ref(x) for x in out)
            return _Local._Ref(out)

    class _Actor:
        def __init__(self, owner: "_Local", obj: Any) -> None:
            self._owner, self._obj = owner, obj

        def __getattr__(self, name: str) -> Any:
            return _Local._Method(self._owner, getattr(self._obj, name))

    class _Class:
        def __init__(self, owner: "_Local", cls: type) -> None:
            self.owner, self.cls = owner, cls

        def options(self, **_: Any) -> "_Local._Class":
            return self

        def remote(self, *args: Any) -> "_Local._Actor":
            return _Local._Actor(self.owner, self.cls(*args))

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def remote(self, cls: type) -> "_Local._Class":
        return _Local._Class(self, cls)

    def get(self, refs: Any) -> Any:
        if isinstance(refs, list):
            return [r.value for r in refs]
        return refs.value

    def wait(self, refs: list, num_returns: int = 1) -> tuple[list, list]:
        """Every ref is already done here: the first ``num_returns`` (launch order)."""
        return list(refs[:num_returns]), list(refs[num_returns:])

    def shutdown(self) -> None:
        self.loop.close()


def main_job(cfg: RunConfig, host: PluginHost, out_dir: str | None = None, ray_address: str | None = None,
             resume: bool = False, recipe_name: str = "run", local: bool = False) -> Path:
    """Run RL training end to end; returns the run directory. ``local`` runs the rollout
    worker and trainer in this process without Ray (synchronous; debugging and tests).

    Writes ``config.toml``, ``metrics.jsonl`` (one row per step), ``trajectories.jsonl``
    (a sample), ``checkpoints/`` and ``reward.png``. With ``resume`` it continues from the
    run directory's latest checkpoint: weights, optimizer, RNG, version and data cursor.

    Raises:
        ValueError: bad agent configuration (before any compute).
        FileNotFoundError: ``resume`` without a checkpoint.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from molt_core.trainer import latest_checkpoint

    console = Console(stderr=True)
    cfg = _absolute(cfg)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(out_dir or cfg.run.out_dir or f"runs/{recipe_name}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # validate everything a worker will build before any compute starts
    agent = load_agent(cfg, host)
    check_rewards(cfg, host)
    agent_name = cfg.agent.name or cfg.agent.path
    check_train_split(agent, cfg.run.seed, cfg.run.steps * cfg.rollout.prompts_per_step, agent_name)
    eval_tasks = list(itertools.islice(agent.tasks("eval", cfg.run.seed), cfg.eval.n_problems))
    cfg.write(run_dir / "config.toml")  # on --resume too, so --set changes persist
    ray = _Local() if local else _init_ray(cfg, ray_address)
    cfg_dict = cfg.model_dump(by_alias=True)
    t_start = time.perf_counter()
    Trainer_ = ray.remote(TrainerWorker).options(num_cpus=cfg.trainer.num_cpus, num_gpus=cfg.trainer.num_gpus)
    Worker_ = ray.remote(RolloutWorker).options(num_cpus=cfg.engine.num_cpus, num_gpus=cfg.engine.num_gpus,
                                                resources=dict(cfg.engine.resources) or None, max_concurrency=1000)
    trainer = Trainer_.remote(cfg_dict)
    workers = [Worker_.remote(cfg_dict, i) for i in range(cfg.engine.num_engines)]
    placement = {"rollout_workers": ray.get([w.placement.remote() for w in workers])}
    (run_dir / "placement.json").write_text(json.dumps(placement, indent=1))

    cursor = {"step": 0, "tasks": 0}
    ckpt = latest_checkpoint(run_dir) if resume else None
    if resume:
        if ckpt is None:
            raise FileNotFoundError(f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'}")
        cursor = dict(ray.get(trainer.restore.remote(str(ckpt))))
        console.print(f"[bold]resuming[/] {run_dir} from {ckpt.name} (step {cursor['step']})")
    log = RunLog(run_dir, cfg, host, resume_step=cursor["step"] if resume else None)
    if not resume and cfg.sft.steps > 0:
        with console.status(f"SFT warm start: {cfg.sft.steps} steps"):
            sft_m = ray.get(trainer.sft.remote())
        console.print(f"SFT warm start: loss {sft_m['sft/loss_first']:.3f} -> {sft_m['sft/loss_last']:.3f}")

    def publish() -> int:
        # two object refs, resolved inside each worker: weights never pass through the driver
        state_ref, version_ref = trainer.weights.options(num_returns=2).remote()
        versions = ray.get([w.load_weights.remote(state_ref, version_ref) for w in workers])
        return int(versions[0])

    version = publish()


    def evaluate() -> dict[str, float]:
        if not eval_tasks:
            return {}
        shards = [eval_tasks[i::len(workers)] for i in range(len(workers))]
        res = ray.get([w.evaluate.remote(s, cfg.eval.k, cfg.eval.temperature) for w, s in zip(workers, shards) if s])
        sizes = [len(s) for s in shards if s]
        return {k: sum(r[k] * n for r, n in zip(res, sizes)) / sum(sizes) if not k.endswith("failed") else sum(r[k] for r in res)
                for k in res[0]}

    train_stream = TaskStream(agent, cfg.run.seed, start=cursor["tasks"], name=agent_name)  # epochs; resumable cursor
    epoch_of: dict[Any, int] = {}  # group ref -> epoch over the train split of its task
    start_step = cursor["step"]
    if start_step == 0:
        m0 = evaluate()
        if m0:
            log.log(0, {"policy_version": float(version), **m0})
            console.print(f"eval at start: pass@1 {m0['eval/pass@1']:.3f}")

    P, n = cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt
    # in flight: one object ref per group, oldest launch first, with the policy version it started at
    inflight: deque = deque()
    launched = start_step * P  # groups
    tasks_done = cursor["tasks"]

    def launch() -> None:
        # one step's worth of groups, sharded over the workers (one call per worker keeps the
        # engine's batch full); each group gets its own ref so a step can take whichever are done
        nonlocal launched
        tasks, epochs = [], []
        for _ in range(min(P, cfg.run.steps * P - launched)):
            tasks += train_stream.take(1)
            epochs.append(train_stream.epoch)
        loads = ray.get([w.load.remote() for w in workers]) if len(workers) > 1 else [0]
        order = sorted(range(len(workers)), key=lambda i: loads[i])
        shards = [tasks[i::len(workers)] for i in range(len(workers))]
        for i, sh in enumerate(shards):
            if sh:
                refs = workers[order[i]].rollout_each.options(num_returns=len(sh)).remote(sh, n)
                refs = refs if len(sh) > 1 else (refs,)
                inflight.extend((version, r) for r in refs)
                epoch_of.update(zip(refs, epochs[i::len(workers)]))
        launched += len(tasks)

    def take(k: int) -> tuple[list[tuple[int, Group]], int]:
        # the first k groups to finish (oldest launch first among those done); the rest stay in
        # flight and may be trained later, with tokens older than async.max_staleness (gated).
        # Also returns the newest epoch (over the train split) among their tasks.
        ready = set(ray.wait([r for _, r in inflight], num_returns=k)[0])
        picked = [(v, r) for v, r in inflight if r in ready]
        for item in picked:
            inflight.remove(item)
        epoch = max((epoch_of.pop(r, 0) for _, r in picked), default=0)
        return [(v, g) for (v, _), g in zip(picked, ray.get([r for _, r in picked]))], epoch

    columns = [TextColumn("[bold]molt run[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    last_eval: dict[str, float] = {}
    skipped_steps = 0
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("rl", total=cfg.run.steps, completed=start_step, info="")
        for step in range(start_step, cfg.run.steps):
            t0 = time.perf_counter()
            # the driver bounds how far ahead groups START ((1 + max_staleness) * P in flight: in
            # launch order a group is at most max_staleness versions old when trained); the
            # trainer's gate bounds the OLDEST TOKEN, so a group that finishes late is dropped, counted
            while len(inflight) < (1 + cfg.async_.max_staleness) * P and launched < cfg.run.steps * P:
                launch()
            started, epoch = take(min(P, len(inflight)))
            groups = [g for _, g in started]
            ntasks = len(groups)
            start_lag = max(version - v for v, _ in started) if started else 0
            t1 = time.perf_counter()
            trajs, rm = assemble_batch(groups, cfg.rollout.dynamic_filter, list(cfg.rewards))
            for g in groups:
                for t in g.trajectories:
                    host.on_trajectory(t)
            if trajs:
                tm = ray.get(trainer.train_step.remote(trajs))
            else:
                tm = {"train/skipped": 1.0}
            if tm.get("train/skipped", 0.0) >= 1.0:
                skipped_steps += 1
                errors = [t.error for g in groups for t in g.trajectories if t.error]
                if skipped_steps == 1:  # say why, once, instead of training on nothing silently
                    why = (f"{len(errors)} of {int(rm['rollout/trajectories'])} rollouts failed, e.g. {errors[0]!r}"
                           if errors else f"{int(rm['rollout/groups_dropped'])} groups had < 2 usable rollouts, "
                           f"{int(rm['rollout/groups_filtered'])} were filtered; or the gate dropped every sequence")
                    progress.console.print(f"[bold yellow]warning:[/] step {step + 1} trained on nothing: {why}")
            t2 = time.perf_counter()
            version = publish()
            t3 = time.perf_counter()
            tasks_done += ntasks
            metrics = {"policy_version": float(version), **rm, **tm, "rollout/epoch": float(epoch),
                       "async/start_lag_max": float(start_lag),
                       "time/rollout": t1 - t0, "time/train_step": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
                       "time/elapsed": t3 - t_start}
            s1 = step + 1
            if cfg.eval.every and s1 % cfg.eval.every == 0 and s1 < cfg.run.steps:
                last_eval = evaluate()
                metrics.update(last_eval)
            if s1 == cfg.run.steps:
                last_eval = evaluate()
                metrics.update(last_eval)
            log.log(s1, metrics)
            if s1 == 1 or s1 % 10 == 0:
                log.trajectories(s1, [t for g in groups[:1] for t in g.trajectories])
            if (cfg.checkpoint.every and s1 % cfg.checkpoint.every == 0) or s1 == cfg.run.steps:
                # in-flight rollouts past this step are regenerated after a resume
                ray.get(trainer.save.remote(str(run_dir), {"step": s1, "tasks": tasks_done}))
            if s1 % 10 == 0 or s1 == cfg.run.steps:
                log.plot()
            info = f"reward {rm['reward/mean']:.3f}" if not math.isnan(rm["reward/mean"]) else "reward -"
            if last_eval:
                info += f"  eval pass@1 {last_eval.get('eval/pass@1', float('nan')):.3f}"
            progress.update(bar, advance=1, info=info)
    log.plot()
    log.close()
    if cfg.run.steps > start_step and skipped_steps == cfg.run.steps - start_step:
        ray.shutdown()
        raise RunFailed(f"no step of {run_dir} trained (every step was skipped; see the warning above and "
                        f"rollout/failed in metrics.jsonl)")
    first = next((r for r in log.rows if r.get("eval/pass@1") is not None), None)
    final = next((r for r in reversed(log.rows) if r.get("eval/pass@1") is not None), None)
    if first and final:
        console.print(f"eval pass@1 (held-out, T={cfg.eval.temperature}): {first['eval/pass@1']:.3f} -> {final['eval/pass@1']:.3f}")
    console.print(f"run directory: {run_dir}  ({time.perf_counter() - t_start:.0f} s)")
    ray.shutdown()  # stops a cluster we started; only disconnects from a joined one
    return run_dir

