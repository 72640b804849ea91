"""Ray actors of the main job: the :class:`RolloutWorker` (engine, agent runner, loopback server,
rewards; runs ``n`` rollouts per task, scores each group, evaluates held-out tasks) and the
:class:`TrainerWorker` (one :class:`~molt_core.train.Trainer`), plus what builds them from the config.
Both run in-process too (``molt run --local``, tests).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import traceback
from collections.abc import Callable
from typing import Any

from molt_core.agents import AgentContext, Env, EpisodeState, load_agent
from molt_core.config import RunConfig, text_hint
from molt_core.ledger import Ledger, take_turn
from molt_core.models import DTYPES, check_model_positions, device_for
from molt_core.rollout.evalstats import eval_metrics, eval_seed, pass_at_k, sample_seed, task_result
from molt_core.plugins import PluginHost, load_plugins, modality, use_run_plugins, window_prover
from molt_core.rewards import JudgeEndpoint, Rollout, reward_spec
from molt_core.rollout.scoring import RewardRunner
from molt_core.runtime.collective_sync import worker_transport
from molt_core.runtime.weightpack import as_state_dict, pack_state
from molt_core.train import Trainer
from molt_core.train.sft import warm_start_steps
from molt_core.types import Group, Result, RewardFailed, SamplingParams, Trajectory, new_id

__all__ = ["RolloutWorker", "TrainerWorker", "check_rewards", "load_agent", "pass_at_k", "where"]


def check_rewards(cfg: RunConfig, host: PluginHost) -> None:
    """Check every ``[rewards.<name>]`` table before any compute: a registered name, valid ``weight`` /
    ``timeout_s``, and the other options valid against the reward's ``Options`` Pydantic model if any.

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
                bad = "; ".join(f"{w}: {x['msg']}{text_hint(w, x)}"
                                for x in e.errors() for w in [f"rewards.{name}.{'.'.join(map(str, x['loc']))}"])
                raise ValueError(f"invalid reward options: {bad}") from None


def where() -> dict[str, str]:
    """Where this process runs: ``{"node_id", "hostname", "pid"}`` (node id ``""`` without Ray)."""
    import socket

    node = ""
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:  # pragma: no cover
        pass
    return {"node_id": node, "hostname": socket.gethostname(), "pid": str(os.getpid())}


def engine_kwargs(cfg: RunConfig, index: int = 0) -> dict[str, Any]:
    """Keyword arguments of the engine factory for rollout worker ``index`` (model, seeds, dtype,
    ``engine.options``; ``device`` from :func:`molt_core.models.device_for` when ``engine.num_gpus > 0``)."""
    e = cfg.engine
    kw: dict[str, Any] = dict(model=cfg.model.path, max_batch_size=e.max_batch_size, dtype=e.dtype,
                              gguf_file=cfg.model.gguf_file, model_seed=cfg.run.seed, seed=cfg.run.seed * 1000 + index)
    if e.num_gpus > 0 and "device" not in e.options:
        kw["device"] = str(device_for(e.num_gpus))
    return {**kw, **e.options}


def _sampling(cfg: RunConfig, stop_token_ids: list[int], temperature: float | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                          top_k=r.top_k, max_tokens=r.max_tokens, stop_token_ids=list(stop_token_ids))


# what one episode opened (its ledgers, chat messages), for rewards that want the whole rollout
_EPISODE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("molt_episode", default=None)
#: the policy version a rollout's first sample must come from (None: whatever the engine holds)
_MIN_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("molt_min_version", default=None)


class RolloutWorker:
    """One engine with its agent runners; a Ray actor in ``molt run`` (usable in-process).

    Args:
        cfg: the run config (a ``RunConfig`` or its dict).
        index: worker index (seeds differ per worker).

    Raises:
        ValueError / PluginError: bad agent or engine config (before any rollout).
    """

    #: rollouts carry the engine's token ids (False for a text-only subclass: molt eval --model URL)
    token_exact = True

    def __init__(self, cfg: RunConfig | dict, index: int = 0) -> None:
        import torch

        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        torch.set_num_threads(self.cfg.run.threads)
        use_run_plugins(self.cfg.plugins)  # the engine reads the modality / routing tool registries
        self.host = load_plugins(self.cfg.plugins)
        self.agent = load_agent(self.cfg, self.host)
        factory = self.host.get("engines", self.cfg.engine.name)
        engine = factory(**engine_kwargs(self.cfg, index))
        self._assemble(engine, self.cfg.rewards, lambda name: self.host.get("rewards", name))
        if self.cfg.teacher.name:  # on-policy distillation: annotates ok trajectories with teacher logprobs
            try:
                teacher_cls = self.host.get("teachers", self.cfg.teacher.name)
            except KeyError as e:
                raise ValueError(f"teacher.name: {e.args[0]}") from None
            self.teacher = teacher_cls(self.tokenizer, **self.cfg.teacher.options)
        if self.rewards.wants_judge_session:
            self._server()  # judges asking the run's own engine get one loopback session per call

    def _assemble(self, engine: Any, rewards: dict[str, dict[str, Any]], lookup: Callable[[str], Any]) -> None:
        """The state shared by ``__init__`` and :meth:`from_parts`: engine, tokenizer, rewards, counters."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.modality = modality(getattr(self, "host", None))
        self.window_prover = window_prover(getattr(self, "host", None))
        self.rewards = RewardRunner(rewards, lookup, self.cfg.rollout.reward_concurrency, open_session=self._judge_session)
        self.teacher = None
        self.template_kwargs = dict(self.cfg.model.chat_template_kwargs)
        self.server = None
        self.inflight = 0
        self.first_failure: str | None = None  # traceback of the first rollout whose agent raised
        # the version held after the last load (None: initial weights), a failed load's error, the waiters' event
        self._held_version: int | None = None
        self._load_error: BaseException | None = None
        self._weights_event: asyncio.Event | None = None
        self._stop_ids = Ledger(self.tokenizer, chat_template_kwargs=self.template_kwargs).stop_token_ids

    @classmethod
    def from_parts(cls, cfg: RunConfig, agent: Any, engine: Any, rewards: dict[str, dict[str, Any]],
                   lookup: Callable[[str], Any]) -> "RolloutWorker":
        """A worker around a caller-built agent and engine, no plugins or teacher (``molt_core.testing.run_episode``).
        Raises: ValueError -- as :class:`~molt_core.rollout.scoring.RewardRunner` for bad reward options."""
        w = cls.__new__(cls)
        w.cfg, w.agent = cfg, agent
        w._assemble(engine, rewards, lookup)
        return w

    # -- episodes -------------------------------------------------------------------------
    def _server(self):
        """The worker's loopback server (started on first use)."""
        if self.server is None:
            # imported here: the web stack loads only in a run that needs it
            from molt_core.server.app import start_server

            self.server = start_server(self.engine, self.tokenizer, chat_template_kwargs=self.template_kwargs,
                                       image_policy=self.cfg.images, modality=self.modality,
                                       window_prover=self.window_prover)
        return self.server

    def _ledger(self, group_id: str):
        ledger = Ledger(self.tokenizer, group_id=group_id, chat_template_kwargs=self.template_kwargs,
                        vision=getattr(self.engine, "vision_processor", None), image_policy=self.cfg.images,
                        modality=self.modality, window_prover=self.window_prover)
        seen = _EPISODE.get()
        if seen is not None:  # rewards that want the whole rollout read its messages
            seen["ledgers"].append(ledger)
        return ledger

    def _judge_session(self) -> tuple[JudgeEndpoint, Any]:
        """A fresh loopback session for one judge call and its closer (never trained on)."""
        sess = self._server().create_session(group_id="judge")
        return JudgeEndpoint(sess.openai_base_url, sess.api_key), lambda: self.server.close_session(sess.session_id)

    async def _env_episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, str]:
        env: Env = self.agent  # type: ignore[assignment]
        r = self.cfg.rollout
        ledger = self._ledger(group_id)
        messages: list[dict[str, Any]] = env.first_messages(task)
        state = EpisodeState(task=task)
        reward, score, truncated, info = 0.0, None, False, {}
        action = ""
        seed = params.seed  # a seeded episode (eval) seeds turn t with seed + t
        for turn in range(r.max_turns):
            p = params.model_copy(update={"seed": None if seed is None else (seed + turn) % (1 << 63)})
            sampled = await self._env_turn(ledger, messages, p)
            if sampled is None:
                truncated = True
                break
            action, messages = sampled
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

    async def _env_turn(self, ledger: Any, messages: list[dict[str, Any]],
                        params: SamplingParams) -> tuple[str, list[dict[str, Any]]] | None:
        """One Env turn: ``(action text, history)``, or None when ``rollout.max_total_tokens`` leaves no room."""
        async def weights(p: SamplingParams) -> SamplingParams:
            await self._weights_at(_MIN_VERSION.get())  # the prompt was prepared while the weights travelled
            return p

        turn = await take_turn(ledger, self.engine, messages, params, max_total_tokens=self.cfg.rollout.max_total_tokens,
                               before_engine=weights)
        if turn is None:
            return None
        out = turn.token_ids  # the engine's finish reason "stop" reads "tool_calls" once calls are parsed
        ids = out[:-1] if (turn.finish_reason in ("stop", "tool_calls") and out and out[-1] in self._stop_ids) else out
        return self.tokenizer.decode(ids, skip_special_tokens=False), ledger.history

    async def _chat_episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, str]:
        await self._weights_at(_MIN_VERSION.get())  # the agent's loop may call the engine at once
        sess = self._server().create_session(group_id=group_id, chat_template_kwargs=self.template_kwargs,
                                             seed=params.seed)
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
        # unvalidated (score_group checks the numbers); the ledger's truncation and info keys win over the agent's
        traj = traj.model_copy(update={"reward": res.reward, "score": res.score, "task": task,
                                       "truncated": traj.truncated or res.truncated, "info": {**res.info, **traj.info}})
        seen = _EPISODE.get()
        if seen is not None:
            seen["messages"] = messages
        return traj, action

    async def _episode(self, task: dict, group_id: str, params: SamplingParams) -> tuple[Trajectory, Rollout | None]:
        """Run the agent on ``task``: the unscored trajectory and its :class:`Rollout` (None: failed; never raises)."""
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
            tb = "".join(traceback.format_exception(e))
            if self.first_failure is None:
                self.first_failure = tb
            return Trajectory(group_id=group_id, task=task, status="failed", error=f"{type(e).__name__}: {e}",
                              info={"traceback": tb}), None
        ledger = next((lg for lg in seen["ledgers"] if lg.rollout_id == traj.rollout_id), None)
        messages = seen["messages"] if seen["messages"] is not None else (ledger.history if ledger is not None else [])
        if self.token_exact and (not traj.segments or traj.num_sampled == 0):
            return traj.fail("the rollout sampled no token"), None
        return traj, Rollout(response=action, task=task, messages=messages, trajectory=traj)

    async def _group(self, task: dict, group_id: str, params: SamplingParams, n: int,
                     seeds: list[int] | None = None) -> list[Trajectory]:
        """``n`` rollouts of ``task`` (rollout ``j`` seeded ``seeds[j]``), scored together, then teacher-annotated."""
        ps = [params] * n if seeds is None else [params.model_copy(update={"seed": s}) for s in seeds]
        items = await asyncio.gather(*(self._episode(task, group_id, p) for p in ps))
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

    async def rollout(self, tasks: list[dict], n: int, min_version: int | None = None,
                      indices: list[int] | None = None) -> list[Group]:
        """Run ``n`` rollouts of each task concurrently; each group is scored once its ``n`` finish. With
        ``min_version``, no rollout samples before the engine holds that policy version.

        Args:
            indices: each task's index in the task stream: rollout ``j`` of task ``indices[i]`` samples with seed
                :func:`~molt_core.rollout.evalstats.sample_seed` ``("train", run.seed, indices[i], j)`` (turn
                ``t``: that + ``t``). None: the engine's own seed stream.

        Returns:
            One :class:`Group` per task, trajectories in completion-independent order.

        Raises:
            ValueError: ``indices`` does not have one entry per task.
        """
        if indices is not None and len(indices) != len(tasks):
            raise ValueError(f"indices has {len(indices)} entries for {len(tasks)} tasks; give one stream index per task")
        self.inflight += len(tasks) * n
        _MIN_VERSION.set(min_version)  # the episodes' tasks below inherit it
        try:
            params = _sampling(self.cfg, self._stop_ids)
            groups = [Group(task=t) for t in tasks]
            seeds = ([None] * len(tasks) if indices is None else
                     [[sample_seed("train", self.cfg.run.seed, i, j) for j in range(n)] for i in indices])
            scored = await asyncio.gather(*(self._group(g.task, g.group_id, params, n, s) for g, s in zip(groups, seeds)))
            for g, trajs in zip(groups, scored):
                g.trajectories = list(trajs)
            return groups
        finally:
            self.inflight -= len(tasks) * n

    async def rollout_group(self, task: dict, n: int, min_version: int | None = None,
                            index: int | None = None) -> Group:
        """:meth:`rollout` of one task (``index``: its stream position), so each group's ref is ready on its own."""
        return (await self.rollout([task], n, min_version, None if index is None else [index]))[0]

    async def evaluate_tasks(self, tasks: list[dict], n: int, temperature: float,
                             indices: list[int] | None = None) -> list[dict[str, Any]]:
        """Sample ``n`` rollouts per task at ``temperature``, sample ``j`` of eval index ``indices[i]`` (default ``i``)
        seeded :func:`~molt_core.rollout.evalstats.eval_seed` ``(run.seed, index, j)``; one ``task_result`` per task."""
        indices = list(range(len(tasks))) if indices is None else [int(i) for i in indices]
        if len(indices) != len(tasks):
            raise ValueError(f"indices has {len(indices)} entries for {len(tasks)} tasks")
        params = _sampling(self.cfg, self._stop_ids, temperature=temperature)
        seed = self.cfg.run.seed
        per_task = await asyncio.gather(*(self._group(t, new_id("eval"), params, n, [eval_seed(seed, i, j) for j in range(n)])
                                          for t, i in zip(tasks, indices)))
        return [task_result(i, t, list(ts)) for i, t, ts in zip(indices, tasks, per_task)]

    async def evaluate(self, tasks: list[dict], k: int, temperature: float, indices: list[int] | None = None) -> dict[str, float]:
        """:meth:`evaluate_tasks` with ``k`` samples, as :func:`~molt_core.rollout.evalstats.eval_metrics`."""
        return eval_metrics(await self.evaluate_tasks(tasks, k, temperature, indices), k)

    async def load_weights(self, state: Any, version: int) -> int:
        """Hand ``state`` (name -> tensor, or a :class:`~molt_core.runtime.weightpack.PackedState`) to the engine,
        applied between decode steps; returns ``version``."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.load_weights, as_state_dict(state), version)
        except BaseException as e:  # rollouts waiting for this version fail instead of waiting forever
            self._loaded(None, e)
            raise
        self._loaded(version)
        return version

    def _loaded(self, version: int | None, error: BaseException | None = None) -> None:
        """Record the held ``version`` (or a failed load) and wake :meth:`_weights_at`'s waiters."""
        if version is not None:
            self._held_version = version if self._held_version is None else max(self._held_version, version)
        if error is not None:
            self._load_error = error
        if self._weights_event is not None:
            self._weights_event.set()
            self._weights_event = None

    async def _weights_at(self, version: int | None) -> None:
        """Wait until the engine holds policy ``version`` (None: no wait).
        Raises: RuntimeError -- a weight load failed while waiting."""
        while version is not None and (self._held_version is None or self._held_version < version):
            if self._load_error is not None:
                raise RuntimeError(f"waiting for policy version {version}: the weight load failed: {self._load_error!r}")
            if self._weights_event is None:
                self._weights_event = asyncio.Event()
            await self._weights_event.wait()

    # -- weight-sync transport (engine.weight_sync = "collective": molt_core.runtime.collective_sync)
    def sync_world_size(self) -> int:
        """Members this worker's engine adds to the weight-sync group (its vLLM workers)."""
        return int(worker_transport(self, self.host).receivers(self.engine))

    async def sync_init(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float = 600.0) -> str:
        """Join the engine to the weight-sync group (blocks until it formed); returns the backend."""
        return await asyncio.get_running_loop().run_in_executor(
            None, worker_transport(self, self.host).join, self.engine, host, port, rank_offset, world_size, timeout_s)

    async def sync_receive(self, version: int) -> int:
        """Receive the trainer's broadcast of ``version``; returns the bytes. Raises: ValueError -- engine refused."""
        got = await asyncio.get_running_loop().run_in_executor(None, worker_transport(self, self.host).receive,
                                                               self.engine, version)
        self._loaded(version)
        return got

    def failure(self) -> str | None:
        """The traceback of the first rollout on this worker whose agent raised, or None."""
        return self.first_failure

    def load(self) -> int:
        """Rollouts in flight on this worker (the router's load measure)."""
        return self.inflight

    def placement(self) -> dict[str, str]:
        """Where this worker runs: :func:`where`."""
        return where()


class TrainerWorker:
    """The single trainable actor wrapped for Ray (see :class:`molt_core.train.Trainer`)."""

    def __init__(self, cfg: RunConfig | dict, build: bool = True) -> None:
        """``build`` False leaves ``self.trainer`` None (:mod:`molt_core.runtime.trainer_group` builds it)."""
        import torch

        self.cfg = cfg if isinstance(cfg, RunConfig) else RunConfig.model_validate(cfg)
        torch.set_num_threads(self.cfg.run.threads)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
        self.trainer = Trainer(self.cfg) if build else None
        if self.trainer is not None:  # (the driver read config.json; a GGUF file's config is known only here)
            check_model_positions(self.cfg.model.path, self.trainer.model.config)

    def placement(self) -> dict[str, str]:
        """:func:`where`, shaped as a sharded rank's entry: ``rank`` "0", ``backend`` "none"."""
        return {"rank": "0", **where(), "backend": "none"}

    def start_check_process(self) -> bool:
        """:meth:`molt_core.train.Trainer.start_check_process` (False on a sharded rank)."""
        return self.trainer.start_check_process()

    def sft(self) -> dict[str, float]:
        """The whole warm start in one call; returns ``sft/loss_first``, ``sft/loss_last`` (NaN with no step)."""
        ms = self.sft_next(self.sft_begin())
        return {"sft/loss_first": ms[0]["sft/loss"] if ms else float("nan"),
                "sft/loss_last": ms[-1]["sft/loss"] if ms else float("nan")}

    def sft_begin(self, start: int = 0) -> int:
        """Prepare the warm start (:func:`molt_core.train.sft.warm_start_steps`, as ``molt sft``), from step
        ``start`` of a restored mid-warm-start checkpoint; returns its total steps (``sft.steps``): run the
        remaining ones with :meth:`sft_next`.

        Raises:
            ValueError: the agent cannot be built or its tasks have no answers.
        """
        agent = load_agent(self.cfg, load_plugins(self.cfg.plugins))
        self._sft = warm_start_steps(self.trainer, agent, start)
        return max(0, self.cfg.sft.steps)

    def sft_next(self, k: int) -> list[dict[str, float]]:
        """Run up to ``k`` more warm-start steps; returns their metrics (``sft/loss``, ...).
        Raises: RuntimeError -- :meth:`sft_begin` was not called."""
        if getattr(self, "_sft", None) is None:
            raise RuntimeError("sft_next before sft_begin")
        return [m for _, m in zip(range(k), self._sft)]  # range first: no step drawn past the k-th

    def train_step(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One optimizer step; returns the trainer's metrics and ``policy_version``."""
        m = self.trainer.train_step(trajectories)
        m["policy_version"] = float(self.trainer.version)
        m["sync/bytes"] = float(getattr(self, "_sync_bytes", 0))  # what each publish moves to an engine
        return m

    def weights(self) -> tuple[Any, int]:
        """``(state, version)`` to publish: the state dict packed into one buffer cast to ``engine.dtype``
        (:func:`molt_core.runtime.weightpack.pack_state`); a sharded trainer's ranks past 0 send an empty pack."""
        state = pack_state(self.trainer.weights(), dtype=DTYPES[self.cfg.engine.dtype])
        self._sync_bytes = state.nbytes
        return state, self.trainer.version

    def policy_version(self) -> int:
        """The trainer's current policy version."""
        return int(self.trainer.version)

    # -- weight-sync transport (the sender is rank 0: molt_core.runtime.collective_sync)
    def sync_address(self) -> tuple[str, int]:
        """``(ip, port)`` where this rank can host the weight-sync group's store."""
        return worker_transport(self).free_address()

    def sync_init(self, host: str, port: int, world_size: int, timeout_s: float = 600.0) -> str:
        """Rank 0: join the weight-sync group as its sender, until every engine joined; returns the backend
        (other ranks: ``""``)."""
        if getattr(self.trainer, "rank", 0) != 0:
            return ""
        self._sync_group = worker_transport(self).sender(host, port, world_size, self.trainer.device, timeout_s)
        return self._sync_group.backend

    def sync_send(self) -> int:
        """Broadcast the full weights (cast to ``engine.dtype``; every rank calls it); returns the version.
        Raises: RuntimeError -- :meth:`sync_init` was not called on rank 0."""
        state = self.trainer.weights()
        if getattr(self.trainer, "rank", 0) == 0:
            group = getattr(self, "_sync_group", None)
            if group is None:
                raise RuntimeError("sync_send before sync_init: the trainer has not joined a weight-sync group")
            self._sync_bytes = worker_transport(self).send(group, state, self.trainer.version,
                                                           DTYPES[self.cfg.engine.dtype])
        return int(self.trainer.version)

    def save(self, run_dir: str, cursor: dict) -> str:
        """Write a checkpoint (atomic, retention per ``checkpoint.keep``); returns its path."""
        return str(self.trainer.save_checkpoint(run_dir, cursor))

    def restore(self, path: str) -> dict:
        """Load a checkpoint; returns its data cursor."""
        return self.trainer.load_checkpoint(path)
