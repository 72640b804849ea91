"""The trainer, split by job.

* :mod:`molt_core.train.ingress` -- finished rollouts -> a padded :class:`Batch` (checks).
* :mod:`molt_core.train.trainer` -- :class:`Trainer`: orchestrates a step (recompute,
  correction, advantages, the update), weight export.
* :mod:`molt_core.train.forward` -- logprob forwards (:func:`token_logprobs`);
  :mod:`molt_core.train.update` -- LR schedule (:func:`lr_factor`), policy loss over
  micro-batches, optimizer steps; :mod:`molt_core.train.critic` -- the GAE critic
  (:class:`ValueModel`); :mod:`molt_core.train.metrics` -- the metrics of a step. MoE routing
  replay (R3) is a routing tool's (``molt_register_routing_tools``; molt-sdk's: :mod:`molt_plugins.moe`).
* :mod:`molt_core.train.checkpoint` -- atomic, Hugging Face-loadable checkpoints
  (:mod:`molt_core.train.model_files`: one module's weight files).
* :mod:`molt_core.train.distributed` -- :class:`ShardedTrainer`: ``trainer.world_size`` ranks,
  one FSDP2-sharded model; :mod:`molt_core.train.dist_checkpoint` -- the ``dcp/`` part of its checkpoints
  (``torch.distributed.checkpoint``; written by :func:`molt_core.train.checkpoint.save_sharded_checkpoint`).
"""

from molt_core.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint, list_checkpoints
from molt_core.train.ingress import Batch, IngressError, build_batch
from molt_core.train.trainer import Trainer, ValueModel, lr_factor, token_logprobs

__all__ = ["CHECKPOINT_DIR", "Batch", "IngressError", "Trainer", "ValueModel", "build_batch", "latest_checkpoint",
           "list_checkpoints", "lr_factor", "token_logprobs"]
