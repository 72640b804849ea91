"""The step loop of ``molt run``: start Ray (or run in-process), place the workers, warm-start,
then per step launch groups, assemble the batch, train, publish weights, evaluate, checkpoint
and log (the async semantics: docs/architecture.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from molt_core.config import ConfigError, RunConfig
from molt_core.models import (check_model_positions, check_model_source, declares_vision, load_tokenizer, model_config,
                              routing_tool)
from molt_core.rollout.evalstats import eval_metrics
from molt_core.plugins import PluginHost, check_modality_options, modality
from molt_core.train.progress import step_progress
from molt_core.rollout.scoring import component_metrics
from molt_core.runtime.collective_sync import connect as connect_collective
from molt_core.runtime.collective_sync import publish as publish_collective
from molt_core.runtime.collective_sync import resolve_weight_sync
from molt_core.runtime.raycluster import init_ray
from molt_core.runtime.rundir import RunLog, check_loggers
from molt_core.runtime.trainer_group import describe_ranks, start_trainer_group
from molt_core.agents import load_agent
from molt_core.runtime.workers import RolloutWorker, TrainerWorker, check_rewards
from molt_core.rollout.tasks import TaskStream, check_train_split
from molt_core.train.checkpoint import latest_intact_checkpoint
from molt_core.train.algorithms import resolve_algorithms
from molt_core.train.features import check_trainer_features
from molt_core.types import Group, Trajectory

__all__ = ["RunFailed", "assemble_batch", "main_job"]


class RunFailed(RuntimeError):
    """The run finished but trained nothing (every step was skipped)."""


def assemble_batch(groups: list[Group], dynamic_filter: bool,
                   reward_names: list[str] | tuple[str, ...] = ()) -> tuple[list[Trajectory], dict[str, float]]:
    """Turn finished groups into the step's training trajectories.

    Failed rollouts are excluded (never scored 0); a group with fewer than 2 usable rollouts is dropped;
    with ``dynamic_filter`` a group whose rewards are all equal is dropped (zero advantages; DAPO, arXiv
    2503.14476). Returns the trajectories and the ``rollout/*`` counts, ``reward/mean`` and, per name in
    ``reward_names``, ``reward/NAME/mean`` and ``/failed`` (:func:`molt_core.rollout.scoring.component_metrics`).
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
    for key in ("path", "eval_path"):  # the dataset env's files (any agent's options naming an existing path)
        v = agent.options.get(key)
        if isinstance(v, str) and not Path(v).is_absolute() and Path(v).exists():
            agent = agent.model_copy(update={"options": {**agent.options, key: str(Path(v).resolve())}})
    sft = cfg.sft
    if sft.data and Path(sft.data).exists():
        sft = sft.model_copy(update={"data": str(Path(sft.data).resolve())})
    return cfg.model_copy(update={"plugins": plugins, "agent": agent, "model": model, "teacher": teacher, "sft": sft})


class _Local:
    """The slice of the Ray API ``main_job`` uses, with actors in this process (``molt run --local``, tests):
    coroutine methods run as tasks on one private event loop, which ``get`` / ``wait`` run until their refs
    are done."""

    class _Ref:
        def __init__(self, value: Any = None, task: "asyncio.Task | None" = None) -> None:
            self.value, self.task = value, task

        def done(self) -> bool:
            return self.task is None or self.task.done()

        def result(self) -> Any:
            return self.value if self.task is None else self.task.result()

    class _Method:
        def __init__(self, owner: "_Local", fn: Any, num_returns: int = 1) -> None:
            self.owner, self.fn, self.num_returns = owner, fn, num_returns

        def options(self, num_returns: int = 1, **_: Any) -> "_Local._Method":
            return _Local._Method(self.owner, self.fn, num_returns)

        def remote(self, *args: Any, **kwargs: Any) -> Any:
            args = tuple(self.owner.get(a) if isinstance(a, _Local._Ref) else a for a in args)
            out = self.fn(*args, **kwargs)
            if asyncio.iscoroutine(out):
                if self.num_returns == 1:  # runs while the driver waits, concurrently with the others
                    return _Local._Ref(task=self.owner.loop.create_task(out))
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
        """``ray.get``: the values of ``refs`` (one or a list), running the loop until they are done."""
        items = refs if isinstance(refs, list) else [refs]
        pending = [r.task for r in items if not r.done()]
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending))
        values = [r.result() for r in items]
        return values if isinstance(refs, list) else values[0]

    def wait(self, refs: list, num_returns: int = 1) -> tuple[list, list]:
        """``ray.wait``: ``(ready, rest)`` once ``num_returns`` of ``refs`` are done (ready in ``refs`` order)."""
        want = min(num_returns, len(refs))
        while sum(r.done() for r in refs) < want:
            self.loop.run_until_complete(asyncio.wait([r.task for r in refs if not r.done()],
                                                      return_when=asyncio.FIRST_COMPLETED))
        ready = [r for r in refs if r.done()][:want]
        return ready, [r for r in refs if all(r is not x for x in ready)]

    def shutdown(self) -> None:
        pending = asyncio.all_tasks(self.loop)
        for t in pending:  # calls never waited for (a run that stopped early)
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


def _tasks_at(agent: Any, seed: int, indices: list[int], name: str | None) -> list[tuple[int, dict, int]]:
    """``(index, task, epoch)`` of the train stream's tasks at the sorted 0-based ``indices`` (a fresh stream)."""
    out: list[tuple[int, dict, int]] = []
    if not indices:
        return out
    stream = TaskStream(agent, seed, name=name)
    want = set(indices)
    while stream.drawn <= indices[-1]:
        idx = stream.drawn
        task = stream.next()
        if idx in want:
            out.append((idx, task, stream.epoch))
    return out


def _eval_summary(m: dict[str, float]) -> str:
    """``pass@1 0.250``, with how many eval rollouts failed when any did."""
    failed, n = int(m.get("eval/failed") or 0), int(m.get("eval/rollouts") or 0)
    p1 = m.get("eval/pass@1")
    if failed and n and failed >= n:
        return f"all {n} eval rollouts failed (no pass@1)"
    text = f"pass@1 {p1:.3f}" if p1 is not None else "pass@1 -"
    if failed:
        text += f" ({failed} of {n} eval rollouts failed, counted unsolved)" if n else f" ({failed} eval rollouts failed)"
    return text


def _no_checkpoint_message(run_dir: Path, cfg: RunConfig, corrupt: bool) -> str:
    """What ``--resume`` says when ``run_dir`` holds no usable checkpoint, and what to do."""
    what = "no intact checkpoint" if corrupt else "no checkpoint"
    first = ("after the SFT warm start, " if cfg.sft.steps > 0 else "") + (
        f"every checkpoint.every = {cfg.checkpoint.every} steps" if cfg.checkpoint.every else "at the last step")
    return (f"--resume {run_dir}: {what} in {run_dir / 'checkpoints'} (the run stopped before its first checkpoint, "
            f"written {first}); nothing to resume. Start it again in a new run directory: "
            f"molt run {run_dir / 'config.toml'} --out {run_dir.with_name(run_dir.name + '-restart')}")


def _warm_start(ray: Any, trainer: Any, run_dir: Path, console: Any, every: int = 0, start: int = 0) -> None:
    """The SFT warm start on the trainer actor from step ``start`` (a resume), in chunks behind a progress bar;
    a checkpoint every ``every`` steps (0: none; cursor ``"sft"`` = steps done) and a step-0 checkpoint at the end."""
    total = int(ray.get(trainer.sft_begin.remote(start)))
    chunk = max(1, total // 100)
    first, last, done = float("nan"), float("nan"), start
    with step_progress(console, "SFT warm start", total) as update:
        while done < total:
            ms = ray.get(trainer.sft_next.remote(min(chunk, total - done, every - done % every if every else total)))
            if not ms:
                break
            first = ms[0]["sft/loss"] if done == start else first
            done += len(ms)
            last = ms[-1]["sft/loss"]
            update(done, f"loss {last:.3f}")
            if every and done % every == 0 and done < total:
                ray.get(trainer.save.remote(str(run_dir), {"step": 0, "tasks": 0, "untrained": [], "sft": done}))
    console.print(f"SFT warm start: loss {first:.3f} -> {last:.3f}", highlight=False)
    ray.get(trainer.save.remote(str(run_dir), {"step": 0, "tasks": 0, "untrained": []}))


def _driver_tokenizer_future(cfg: RunConfig, local: bool) -> concurrent.futures.Future:
    """:func:`_driver_tokenizer` as a future, loaded on a thread while Ray starts; with ``local``, now, in this
    thread (transformers' lazy imports are not thread-safe)."""
    if local:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(_driver_tokenizer(cfg))
        return done
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="molt-tokenizer")
    future = pool.submit(_driver_tokenizer, cfg)
    pool.shutdown(wait=False)  # its thread ends once the tokenizer is loaded
    return future


def _driver_tokenizer(cfg: RunConfig) -> Any:
    """The model's tokenizer in the driver (to decode sampled trajectories), or None when it cannot load."""
    try:
        return load_tokenizer(cfg.model.path, gguf_file=cfg.model.gguf_file)
    except (OSError, ValueError, ImportError):
        return None


def main_job(cfg: RunConfig, host: PluginHost, out_dir: str | None = None, ray_address: str | None = None,
             resume: bool = False, recipe_name: str = "run", local: bool = False) -> Path:
    """Run RL training end to end; returns the run directory. ``local`` runs the workers in this process
    without Ray (:class:`_Local`).

    Writes ``config.toml``, ``metrics.jsonl``, ``trajectories.jsonl`` (a decoded sample), ``checkpoints/``
    and ``reward.png``. ``resume`` continues from the latest intact checkpoint (weights, optimizer, RNG,
    version, data cursor); groups in flight at that checkpoint are relaunched first.

    Raises:
        ValueError: bad agent configuration, or a model whose rotary factors depend on a
            forward's length (:func:`molt_core.models.check_model_positions`), before any compute.
        FileNotFoundError: ``resume`` without a checkpoint (before Ray starts).
        ClusterAuthError: joining a cluster without its token
            (:func:`molt_core.runtime.raycluster.prepare_auth`).
    """
    cfg = _absolute(cfg)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(out_dir or cfg.run.out_dir or f"runs/{recipe_name}-{stamp}").resolve()
    try:
        return _main_job(cfg, host, run_dir, ray_address, resume, local)
    except KeyboardInterrupt as e:
        e.run_dir = run_dir  # type: ignore[attr-defined]  # the CLI's resume hint names it
        raise


def preflight(cfg: RunConfig, host: PluginHost, local: bool, model: bool = True) -> tuple[Any, str]:
    """Validate what the workers will build, before any compute and before the run directory
    exists (``molt run --dry-run`` too, with ``model`` False: no model file is read): the agent,
    rewards, loggers, algorithms, trainer features, options of plugins not loaded, the weight
    sync, the engine, and with ``model`` the model's source, rotary factors, vision and MoE needs.
    Returns ``(agent, weight-sync mode)``.

    Raises:
        ConfigError / ValueError / FileNotFoundError / PluginError: naming the option and the fix.
    """
    agent = load_agent(cfg, host)
    check_rewards(cfg, host)
    check_loggers(cfg, host)
    resolve_algorithms(cfg, host)
    check_trainer_features(cfg, host)
    check_modality_options(cfg, host)
    if cfg.trainer.world_size > 1 and local:
        raise ValueError(f"trainer.world_size = {cfg.trainer.world_size} needs Ray (one actor per rank); drop --local")
    sync_mode = resolve_weight_sync(cfg, local, host)  # a transport's plugin missing: refused here, by name
    if cfg.engine.name not in host.names("engines"):
        raise ConfigError(f"engine.name = {cfg.engine.name!r}: no loaded plugin registers that engine (registered: "
                          f"{', '.join(host.names('engines')) or '(none)'}). molt-sdk's plugin molt_engines "
                          "(molt_plugins.engines) registers 'transformers' and 'vllm': do not disable it with "
                          "MOLT_DISABLE_PLUGINS, or load a plugin that registers the engine with --plugin")
    config = None
    if model and not cfg.model.gguf_file:  # (a GGUF repo has no config.json; its file is fetched by the workers)
        check_model_source(cfg.model.path)  # here, not as a cause deep in a Ray worker's traceback
        config = model_config(cfg.model.path)  # None: a plugin's builtin (its own checks)
        if config is not None:  # rotary factors the engine and trainer compute alike; an MoE model without
            check_model_positions(cfg.model.path, config)  # a routing tool: refused here, not in the trainer actor
            routing_tool(SimpleNamespace(config=config), cfg.plugins, cfg.model.routing_replay)
    if modality(host) is None and (declares_vision(cfg.model.path) or getattr(config, "vision_config", None)):
        raise ConfigError(f"model.path = {cfg.model.path!r} is a vision-language model, but no loaded plugin registers a "
                          "modality (molt_register_modalities). molt-sdk's plugin molt_vision (molt_plugins.vision) "
                          "does: do not disable it with MOLT_DISABLE_PLUGINS, or load one with --plugin")
    return agent, sync_mode


def _main_job(cfg: RunConfig, host: PluginHost, run_dir: Path, ray_address: str | None, resume: bool,
              local: bool) -> Path:
    """:func:`main_job` in ``run_dir`` (absolute); ``cfg`` with absolute paths."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True, soft_wrap=True)  # colour only on a terminal; long paths stay on one line
    agent, sync_mode = preflight(cfg, host, local)
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"run directory: {run_dir}", highlight=False, markup=False)
    agent_name = cfg.agent.name or cfg.agent.path
    check_train_split(agent, cfg.run.seed, cfg.run.steps * cfg.rollout.prompts_per_step, agent_name)
    eval_tasks = list(itertools.islice(agent.tasks("eval", cfg.run.seed), cfg.eval.n_problems))
    ckpt, skipped = latest_intact_checkpoint(run_dir) if resume else (None, [])
    for why in skipped:
        console.print(f"[bold yellow]warning:[/] skipping a corrupt checkpoint: {why}")
    if resume and ckpt is None:  # say so before Ray starts
        raise FileNotFoundError(_no_checkpoint_message(run_dir, cfg, bool(skipped)))
    cfg.write(run_dir / "config.toml")  # on --resume too, so --set changes persist
    tokenizer = _driver_tokenizer_future(cfg, local)
    if not local:  # start-up takes seconds: say what the wait is
        console.print("starting Ray" + (f" (joining {ray_address})" if ray_address else "") + " and the workers ...",
                      highlight=False)
    ray = _Local() if local else init_ray(cfg, ray_address)
    cfg_dict = cfg.model_dump(by_alias=True)
    t_start = time.perf_counter()
    Trainer_ = ray.remote(TrainerWorker).options(num_cpus=cfg.trainer.num_cpus, num_gpus=cfg.trainer.num_gpus)
    Worker_ = ray.remote(RolloutWorker).options(num_cpus=cfg.engine.num_cpus, num_gpus=cfg.engine.num_gpus,
                                                resources=dict(cfg.engine.resources) or None, max_concurrency=1000)
    if cfg.trainer.world_size > 1:  # N ranks in a placement group behind one actor-like handle
        trainer = start_trainer_group(ray, cfg, cfg_dict)
    else:
        trainer = Trainer_.remote(cfg_dict)
    workers = [Worker_.remote(cfg_dict, i) for i in range(cfg.engine.num_engines)]
    ranks = trainer.placements if cfg.trainer.world_size > 1 else [ray.get(trainer.placement.remote())]
    placement = {"rollout_workers": ray.get([w.placement.remote() for w in workers]), "trainer_ranks": ranks}
    (run_dir / "placement.json").write_text(json.dumps(placement, indent=1))
    console.print(describe_ranks(ranks), highlight=False, markup=False)

    cursor = {"step": 0, "tasks": 0}
    if ckpt is not None:
        cursor = dict(ray.get(trainer.restore.remote(str(ckpt))))
        what = (f"step {cursor['sft']} of the SFT warm start" if "sft" in cursor else
                "the SFT warm start" if cursor["step"] == 0 else f"step {cursor['step']}")
        console.print(f"[bold]resuming[/] {run_dir} from {ckpt.name} ({what})")
    log = RunLog(run_dir, cfg, host, resume_step=cursor["step"] if resume else None)
    if cfg.sft.steps > 0 and (not resume or "sft" in cursor):  # a resume: only one killed during the warm start
        every = cfg.sft.checkpoint_every if cfg.trainer.world_size == 1 else 0  # sharded: no SFT optimizer saved
        _warm_start(ray, trainer, run_dir, console, every, int(cursor.get("sft", 0)))
    # the on-policy check's process, if the trainer uses one; its start-up overlaps the first rollouts
    trainer.start_check_process.remote()

    if sync_mode != "ray":
        backend = connect_collective(ray, trainer, workers)
        console.print(f"weight sync: {sync_mode} ({backend}) from the trainer's rank 0 into the vLLM workers",
                      highlight=False)

    # the next groups launch with min_version while the engines load weights; loads are awaited before take()
    overlap_publish = sync_mode == "ray"
    loading: list[Any] = []

    def loaded() -> None:
        if loading:  # a failed load raises here, naming its error
            ray.get(list(loading))
            loading.clear()

    def publish(wait: bool = True) -> int:
        if sync_mode != "ray":  # trainer rank 0 -> every vLLM worker, one broadcast
            return publish_collective(ray, trainer, workers)
        # two object refs, resolved inside each worker: weights never pass through the driver
        state_ref, version_ref = trainer.weights.options(num_returns=2).remote()
        loading.extend(w.load_weights.remote(state_ref, version_ref) for w in workers)
        if wait:
            loaded()
        return int(ray.get(version_ref))

    version = publish()

    def evaluate() -> dict[str, float]:
        if not eval_tasks:
            return {}
        loaded()  # evaluate the weights just published
        # seeds depend on the task's index only, so `molt eval` on a checkpoint recomputes these exactly
        idx = list(range(len(eval_tasks)))
        shards = [(eval_tasks[i::len(workers)], idx[i::len(workers)]) for i in range(len(workers))]
        res = ray.get([w.evaluate_tasks.remote(s, cfg.eval.k, cfg.eval.temperature, ix) for w, (s, ix) in zip(workers, shards) if s])
        m = eval_metrics([r for rs in res for r in rs], cfg.eval.k)
        if m.get("eval/failed"):
            say_first_failure()
        return m

    said_failure = False

    def say_first_failure() -> None:
        nonlocal said_failure
        if said_failure:
            return
        tb = next((t for t in ray.get([w.failure.remote() for w in workers]) if t), None)
        if tb:
            said_failure = True
            console.print("[bold red]a rollout failed[/] (its traceback, shown once; later failures are counted in "
                          "rollout/failed and eval/failed):")
            console.print(tb.rstrip(), markup=False, highlight=False)

    # the cursor: "tasks" = stream position, "untrained" = groups in flight at the checkpoint, relaunched first
    untrained = sorted(int(i) for i in cursor.get("untrained", []))
    redo: deque = deque(_tasks_at(agent, cfg.run.seed, untrained, agent_name))  # (index, task, epoch)
    train_stream = TaskStream(agent, cfg.run.seed, start=cursor["tasks"], name=agent_name)  # epochs; resumable cursor
    epoch_of: dict[Any, int] = {}  # group ref -> epoch over the train split of its task
    index_of: dict[Any, int] = {}  # group ref -> index of its task in the stream
    start_step = cursor["step"]
    if start_step == 0 and not any(r.get("step") == 0 for r in log.rows):  # not redone on a resume
        m0 = evaluate()
        if m0:
            log.log(0, {"policy_version": float(version), **m0})
            console.print(f"eval at start: {_eval_summary(m0)}", highlight=False)

    P, n = cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt
    inflight: deque = deque()  # (policy version at launch, group ref), oldest first
    launched = int(cursor["tasks"])  # groups drawn from the stream (relaunches not counted)

    def launch() -> None:
        # one step's groups over the workers, one call (and ref) per group; a resume's untrained ones first
        nonlocal launched
        picked: list[tuple[int, dict, int]] = []
        while redo and len(picked) < P:
            picked.append(redo.popleft())
        while len(picked) < P and launched < cfg.run.steps * P:
            idx = train_stream.drawn
            picked.append((idx, train_stream.next(), train_stream.epoch))
            launched += 1
        loads = ray.get([w.load.remote() for w in workers]) if len(workers) > 1 else [0]
        order = sorted(range(len(workers)), key=lambda i: loads[i])
        for i in range(len(workers)):
            for j, task, e in picked[i::len(workers)]:
                ref = workers[order[i]].rollout_group.remote(  # seeds from the stream index j
                    task, n, version if overlap_publish else None, j)
                inflight.append((version, ref))
                epoch_of[ref], index_of[ref] = e, j

    def take(k: int) -> tuple[list[tuple[int, Group]], int]:
        # the first k groups done, in stream order (independent of sharding), and their newest epoch
        ready = set(ray.wait([r for _, r in inflight], num_returns=k)[0])
        picked = sorted(((v, r) for v, r in inflight if r in ready), key=lambda vr: index_of[vr[1]])
        for item in picked:
            inflight.remove(item)
            index_of.pop(item[1], None)
        epoch = max((epoch_of.pop(r, 0) for _, r in picked), default=0)
        return [(v, g) for (v, _), g in zip(picked, ray.get([r for _, r in picked]))], epoch

    columns = [TextColumn("[bold]molt run[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]
    last_eval: dict[str, float] = {}
    skipped_steps = 0
    # a redirected console prints the bar once, at the end: no refresh thread redrawing it meanwhile
    with Progress(*columns, console=console, transient=False, auto_refresh=console.is_terminal,
                  refresh_per_second=4) as progress:
        bar = progress.add_task("rl", total=cfg.run.steps, completed=start_step, info="")
        for step in range(start_step, cfg.run.steps):
            t0 = time.perf_counter()
            # bounds how far ahead groups start; the trainer's gate bounds the oldest token
            while len(inflight) < cfg.async_.groups_in_flight(P) and (redo or launched < cfg.run.steps * P):
                launch()
            loaded()
            started, epoch = take(min(P, len(inflight)))
            groups = [g for _, g in started]
            start_lag = max(version - v for v, _ in started) if started else 0
            t1 = time.perf_counter()
            trajs, rm = assemble_batch(groups, cfg.rollout.dynamic_filter, list(cfg.rewards))
            if rm["rollout/failed"]:
                say_first_failure()
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
            version = publish(wait=not overlap_publish or step + 1 == cfg.run.steps)
            t3 = time.perf_counter()
            metrics = {"policy_version": float(version), **rm, **tm, "rollout/epoch": float(epoch),
                       "async/start_lag_max": float(start_lag),
                       "time/rollout": t1 - t0, "time/train_step": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
                       "time/elapsed": t3 - t_start, "time/step_end_unix": time.time()}
            s1 = step + 1
            if cfg.eval.every and s1 % cfg.eval.every == 0 and s1 < cfg.run.steps:
                last_eval = evaluate()
                metrics.update(last_eval)
            if s1 == cfg.run.steps:
                last_eval = evaluate()
                metrics.update(last_eval)
            log.log(s1, metrics)
            if s1 == 1 or s1 % 10 == 0 or s1 == cfg.run.steps:  # a sample of the first, every 10th and the last step
                log.trajectories(s1, [t for g in groups[:1] for t in g.trajectories], tokenizer.result())
            if (cfg.checkpoint.every and s1 % cfg.checkpoint.every == 0) or s1 == cfg.run.steps:
                pending = sorted([index_of[r] for _, r in inflight] + [j for j, _, _ in redo])
                ray.get(trainer.save.remote(str(run_dir), {"step": s1, "tasks": launched, "untrained": pending}))
            if s1 % 10 == 0 and s1 < cfg.run.steps:  # on a background thread, at most every 30 s
                log.plot_later(min_interval_s=30.0)
            info = f"reward {rm['reward/mean']:.3f}" if not math.isnan(rm["reward/mean"]) else "reward -"
            if last_eval:
                info += f"  eval {_eval_summary(last_eval)}"
            progress.update(bar, advance=1, info=info)
    if log.plot() is None:  # matplotlib missing: say so rather than leave reward.png out silently
        console.print("note: reward.png not drawn: pip install -e '.[plot]' (matplotlib)", highlight=False, markup=False)
    log.close()
    if cfg.run.steps > start_step and skipped_steps == cfg.run.steps - start_step:
        ray.shutdown()
        raise RunFailed(f"no step of {run_dir} trained (every step was skipped; see the warning above and "
                        f"rollout/failed in metrics.jsonl)")
    first = next((r for r in log.rows if r.get("eval/pass@1") is not None), None)
    final = next((r for r in reversed(log.rows) if r.get("eval/pass@1") is not None), None)
    if first and final:
        console.print(f"eval pass@1 (held-out, T={cfg.eval.temperature}): {first['eval/pass@1']:.3f} -> {final['eval/pass@1']:.3f}"
                      + (f" ({int(final['eval/failed'])} of {int(final['eval/rollouts'])} eval rollouts failed at the end)"
                         if final.get("eval/failed") and final.get("eval/rollouts") else ""), highlight=False)
    console.print(f"run directory: {run_dir}  ({time.perf_counter() - t_start:.0f} s)")
    ray.shutdown()  # stops a cluster we started; only disconnects from a joined one
    return run_dir
