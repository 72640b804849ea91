"""The main job on Ray: rollout workers, the trainer, the async loop, weight sync, checkpoints.

Data flow of one step (docs/README.md): tasks from the agent's ``train`` split -> rollout workers
(engine + ledger [+ loopback server for ChatAgents] + agent runner) -> version-stamped
:class:`~molt_core.types.Trajectory` objects -> reward plugins -> groups (failed rollouts
excluded, groups with < 2 usable rollouts dropped, optional dynamic filter) -> the trainer
(recompute, gate + IS correction, advantages, loss, optimizer step) -> weights published to
every engine as version v+1 -> checkpoint every N steps -> metrics to every logger.

Asynchrony: rollout runs up to ``async.max_staleness`` steps ahead of training (0 =
synchronous). The driver keeps at most ``(1 + max_staleness) * prompts_per_step`` groups in
flight, each its own actor call with its own object ref (ready when that group is scored),
and each step trains on the first ``prompts_per_step`` groups to finish: the driver bounds
how far ahead groups *start* (in launch order, a group is at most ``max_staleness`` versions
old when trained; ``async/start_lag_max``). A weight sync reaches engines between decode steps, so in-flight
generations continue under the new weights (partial rollout) and every token records the
version that sampled it; a slow group can therefore reach the trainer with tokens older than
the bound, and the trainer's gate -- which bounds the *oldest token* of each rollout -- drops
it, visibly (``invariants/staleness_max`` over every token, ``correction/gated_frac``).

Ray: ``molt run`` starts a local cluster unless ``--ray-address`` joins one. Rollout workers
and the trainer are Ray actors placed by their declared ``num_cpus`` / ``num_gpus``. With
several engines, groups go to the least-loaded worker and every request of a session stays
on the worker (and engine) that opened it (session affinity).

Modules: :mod:`molt_core.runtime.workers` (the rollout worker and trainer actors),
:mod:`molt_core.runtime.loop` (the step loop, ``main_job``), :mod:`molt_core.runtime.rundir`
(the run directory).
"""

from molt_core.runtime.loop import RunFailed, assemble_batch, main_job
from molt_core.runtime.rundir import RunLog
from molt_core.runtime.workers import RolloutWorker, TrainerWorker, check_rewards, load_agent, pass_at_k

__all__ = ["RolloutWorker", "RunFailed", "RunLog", "TrainerWorker", "assemble_batch", "check_rewards", "load_agent",
           "main_job", "pass_at_k"]
