"""The trainer, split by job: ``ingress`` (rollouts -> :class:`Batch`), ``trainer`` (:class:`Trainer`,
a step and weight export), ``forward`` (logprob forwards), ``update`` (LR schedule, loss, optimizer),
``critic`` (GAE), ``metrics``, ``checkpoint`` / ``model_files`` (atomic Hugging Face-loadable
checkpoints) and ``features`` (the plugin-provided adapter and sharded backend).
"""

from molt_core.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint, list_checkpoints
from molt_core.train.ingress import Batch, IngressError, build_batch
from molt_core.train.trainer import Trainer, ValueModel, lr_factor, token_logprobs

__all__ = ["CHECKPOINT_DIR", "Batch", "IngressError", "Trainer", "ValueModel", "build_batch", "latest_checkpoint",
           "list_checkpoints", "lr_factor", "token_logprobs"]
