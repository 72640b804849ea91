"""The main job on Ray: rollout workers, the trainer, the async loop, weight sync, checkpoints.

:mod:`molt_core.runtime.workers` (the rollout worker and trainer actors), :mod:`molt_core.runtime.loop`
(the step loop, ``main_job``), :mod:`molt_core.runtime.rundir` (the run directory). The data flow of a
step and the async semantics: docs/architecture.md.
"""

from molt_core.runtime.loop import RunFailed, assemble_batch, main_job, preflight
from molt_core.runtime.rundir import RunLog
from molt_core.runtime.workers import RolloutWorker, TrainerWorker, check_rewards, load_agent, pass_at_k

__all__ = ["RolloutWorker", "RunFailed", "RunLog", "TrainerWorker", "assemble_batch", "check_rewards", "load_agent",
           "main_job", "pass_at_k", "preflight"]
