"""The trainer, split by job.

* :mod:`molt_core.train.ingress` -- finished rollouts -> a padded :class:`Batch` (checks).
* :mod:`molt_core.train.trainer` -- :class:`Trainer`: recompute, correction, advantages,
  the update, weight export.
* :mod:`molt_core.train.checkpoint` -- atomic, Hugging Face-loadable checkpoints.
* :mod:`molt_core.train.distributed` -- :class:`ShardedTrainer`: ``trainer.world_size`` ranks,
  one FSDP2-sharded model; :mod:`molt_core.train.dist_checkpoint` -- its checkpoints
  (``torch.distributed.checkpoint`` + the Hugging Face directory).
"""

from molt_core.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint, list_checkpoints
from molt_core.train.ingress import Batch, IngressError, build_batch
from molt_core.train.trainer import Trainer, ValueModel, lr_factor, token_logprobs

__all__ = ["CHECKPOINT_DIR", "Batch", "IngressError", "Trainer", "ValueModel", "build_batch", "latest_checkpoint",
           "list_checkpoints", "lr_factor", "token_logprobs"]
