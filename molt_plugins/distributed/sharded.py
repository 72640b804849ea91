"""Sharded data-parallel training: ``trainer.world_size`` processes, one FSDP2 model (the
``fsdp2`` trainer backend, :class:`Fsdp2Backend`).

Every process (a *rank*) holds a shard of the policy, the reference and the critic
(``torch.distributed.fsdp.fully_shard`` on each decoder block, then on the root: a block's
parameters are all-gathered for its forward and backward, its gradients reduce-scattered).
The process group is gloo on CPU, NCCL on GPU (:func:`init_distributed`).

How one optimizer step stays the step of world size 1 (:class:`ShardedTrainer`):

* every rank receives the whole step's rollouts and builds the same :class:`Batch`; what is
  cheap and global -- the gate, the importance weights, advantages (group baselines need a
  whole group), every metric -- is computed on the whole batch by every rank;
* each rank runs the forwards of its *share* of the rows (:func:`row_share`, contiguous,
  sizes differing by at most one) in micro-batches of ``trainer.micro_batch_size``; the
  per-row results (logprobs, entropies, values) are summed across ranks
  (``all_reduce``: each row is filled by its owner, zero elsewhere), so every rank then holds
  the logprobs of every row, bit-identical to the owner's;
* the loss of each micro-batch is divided by the *global* action-token count of the step
  (computed from the whole batch), the gradients are *summed* across ranks (the FSDP2
  gradient divide factor is 1), so the gradient is the world-size-1 gradient;
* the clip uses the global norm over every shard (the FSDP2 grads are DTensors, whose norm
  is reduced across ranks);
* FSDP2's collectives need every rank to run the same number of forwards and backwards: a
  rank with fewer micro-batches runs stand-ins (a one-row forward and a zero backward), and
  a micro-batch with no trainable token still runs its forward and a zero backward
  (``Trainer.lockstep``).

Weights for the engines: :meth:`ShardedTrainer.weights` gathers the full state dict onto
rank 0 (CPU); the other ranks get an empty dict.
"""

from __future__ import annotations

import copy
import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from molt_core.config import RunConfig
from molt_core.train.ingress import Batch
from molt_core.train.trainer import Trainer
from molt_core.train.version_history import VersionHistory
from molt_plugins.distributed.checkpoint import full_state_dict, load_dcp, load_model, load_optimizer, save_sharded_checkpoint

__all__ = ["Fsdp2Backend", "ShardedTrainer", "init_distributed", "local_param_bytes", "merge_loss_metrics", "row_share",
           "shard_module"]


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None,
                     timeout_s: float = 600.0) -> str:
    """Join the default torch.distributed process group as ``rank`` of ``world_size``.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of trainer processes.
        init_method: rendezvous URL, e.g. ``file:///tmp/rdzv`` (a file every rank can reach;
            it must not exist before the first rank joins) or ``tcp://127.0.0.1:29500``.
        backend: ``gloo`` or ``nccl``; None picks NCCL when CUDA is available, else gloo.
        timeout_s: collective timeout in seconds.

    Returns:
        The backend used.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` or ``world_size < 1``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} / world_size {world_size}: need world_size >= 1 and 0 <= rank < world_size")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    return backend


def row_share(n_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank ``rank``: contiguous blocks whose sizes differ by at most one
    (``lo = rank * n_rows // world_size``). A rank can get no row when ``n_rows < world_size``.

    Example: 9 rows on 2 ranks -> ``(0, 4)`` and ``(4, 9)``.
    """
    return rank * n_rows // world_size, (rank + 1) * n_rows // world_size


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer: the entries of every ``ModuleList`` named
    ``layers``, ``h`` or ``blocks`` (Hugging Face decoder layouts); none for other models."""
    out: list[torch.nn.Module] = []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            out.extend(m)
    return out


def shard_module(module: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    """Shard ``module`` in place with FSDP2: ``fully_shard`` on each block (:func:`_blocks`),
    then on the root (which takes the rest: embeddings, final norm, head; tied weights stay
    one parameter); every part is resharded after its forward, so ``module.parameters()``
    always returns the sharded parameters. Gradients are summed across ranks, not averaged (divide factor 1, plain
    sum reductions -- gloo has no pre-multiplied sum), because the loss is already divided by
    the global token count.

    Returns:
        ``module`` (now an ``FSDPModule``; its parameters are DTensors sharded on dim 0).
    """
    for part in [*_blocks(module), module]:
        # the root too: FSDP2 leaves a root unsharded after its forward by default, and then
        # module.parameters() would hand out the unsharded tensors (no grads land there)
        fully_shard(part, mesh=mesh, reshard_after_forward=True)
        part.set_gradient_divide_factor(1.0)  # per FSDP module: each has its own reduce-scatter
        part.set_force_sum_reduction_for_comms(True)
    return module


def merge_loss_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Combine each rank's loss metrics of its micro-batches into the step's: ``*_min`` by
    min, ``*_max`` by max, everything else by sum (losses and token counts are sums, and
    per-token means are already weighted by each micro-batch's share of the *global* token
    count). A key absent on a rank (no trainable token there) is left out of its reduction.

    Example: ``[{"loss/total": 1.0, "ratio_max": 2.0}, {"loss/total": 0.5, "ratio_max": 3.0}]``
    -> ``{"loss/total": 1.5, "ratio_max": 3.0}``.
    """
    out: dict[str, float] = {}
    for m in per_rank:
        for k, v in m.items():
            if k not in out:
                out[k] = v
            elif k.endswith("_min"):
                out[k] = min(out[k], v)
            elif k.endswith("_max"):
                out[k] = max(out[k], v)
            else:
                out[k] += v
    return out


def _is_sharded(model: torch.nn.Module | None) -> bool:
    return isinstance(model, FSDPModule)


class _FullStateHistory(VersionHistory):
    """:class:`VersionHistory` for a sharded policy: each version is the *full* state dict
    (gathered on every rank, kept on CPU), run in a plain (unsharded) shadow on ``device``
    copied from ``template`` -- the policy as built, before sharding (an FSDP module cannot be
    copied), kept on CPU until the shadow is built from it, then dropped: one unsharded copy on
    the device at most, not two."""

    def __init__(self, keep: int, template: torch.nn.Module | None, device: torch.device | None = None) -> None:
        super().__init__(keep)
        self.template = template
        self.device = device

    def record(self, version: int, model: torch.nn.Module) -> None:
        if self.keep == 0:
            return
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

        class _Full:
            def state_dict(self_inner):  # noqa: N805 - a stand-in with the one method record reads
                return full

        super().record(version, _Full())  # type: ignore[arg-type]

    def load(self, version: int, like: torch.nn.Module) -> torch.nn.Module:
        if self.shadow is None and self.template is not None:
            self.shadow = self.template.to(self.device) if self.device is not None else self.template
            self.template = None
        return super().load(version, like)


class Fsdp2Backend:
    """The ``fsdp2`` trainer backend (``molt_register_trainer_backends``): what the kernel calls
    for ``trainer.world_size > 1`` -- join the ranks' process group, build a rank's
    :class:`ShardedTrainer`, and read a distributed checkpoint into any trainer."""

    def init_process_group(self, rank: int, world_size: int, init_method: str) -> str:
        """:func:`init_distributed` (backend picked by device); returns ``gloo`` or ``nccl``."""
        return init_distributed(rank, world_size, init_method)

    def trainer(self, cfg: RunConfig) -> "ShardedTrainer":
        """This rank's :class:`ShardedTrainer` (the process group joined first)."""
        return ShardedTrainer(cfg)

    def load_checkpoint(self, trainer: Any, d: Any) -> None:
        """:func:`molt_plugins.distributed.checkpoint.load_dcp` of ``dcp/`` directory ``d``."""
        load_dcp(trainer, d)

    def load_model(self, module: torch.nn.Module, d: Any) -> None:
        """A plain checkpoint's weights into this rank's shards: :func:`molt_plugins.distributed.checkpoint.load_model`."""
        load_model(module, d)

    def load_optimizer(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """A plain checkpoint's AdamW state into this rank's shards: :func:`molt_plugins.distributed.checkpoint.load_optimizer`."""
        load_optimizer(module, optimizer, state)


FSDP2 = Fsdp2Backend()
"""The backend instance the plugin registers (and every :class:`ShardedTrainer` carries)."""


class ShardedTrainer(Trainer):
    """A :class:`Trainer` that is one rank of ``world_size`` data-parallel ranks (FSDP2).

    Call :func:`init_distributed` first (every rank), then build one per rank with the same
    config, the same model weights (a builtin or directory model loads identically from
    ``run.seed``) and the same reference; give every rank the *same* rollouts for each
    :meth:`train_step` -- each runs the forwards of its own rows and the step's loss, grad norm,
    updated weights and metrics equal those of one :class:`Trainer` on the whole batch
    (within float32 rounding: the gradient is summed in another order).

    Args: as :class:`Trainer`.

    Attributes:
        rank, world_size: this process's place in the default process group.

    Raises:
        RuntimeError: the default process group is not initialised.
    """

    backend = FSDP2
    lockstep = True
    overlap_onpolicy_check = False  # its forwards are collectives: one thread, one order on every rank

    def __init__(self, cfg: RunConfig, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 ref_model: torch.nn.Module | None = None, replay_backend: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedTrainer needs torch.distributed initialised: call "
                               "molt_plugins.distributed.sharded.init_distributed(rank, world_size, init_method) first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        super().__init__(cfg, model, tokenizer, ref_model, replay_backend)
        self.history = _FullStateHistory(self.history.keep, self._template, self.device)

    # -- sharding ---------------------------------------------------------------------------
    def _shard(self) -> None:
        cfg = self.cfg
        keep = cfg.async_.history_versions
        # the unsharded template of the stale-token shadow waits on CPU (not a second full copy
        # of the policy on the device beside its shards)
        self._template = copy.deepcopy(self.model).to("cpu").eval().requires_grad_(False) if keep else None
        shard_module(self.model)
        if self.ref_model is not None:
            shard_module(self.ref_model)
        if self.critic is not None:
            shard_module(self.critic)

    def reset_reference(self) -> None:
        """Make the frozen reference a copy of the current policy weights (each rank copies
        its own shards; the reference is sharded like the policy).

        Raises:
            RuntimeError: no reference was built at start (``algo.kl_coef`` was 0).
        """
        if not _is_sharded(self.model):  # still building (Trainer.__init__): a plain copy
            return super().reset_reference()
        if self.ref_model is None:
            raise RuntimeError("no reference model to reset: a sharded trainer builds it at start (algo.kl_coef > 0)")
        with torch.no_grad():
            for r, p in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                r.copy_(p)

    # -- the data-parallel seams of Trainer -----------------------------------------------------
    def row_work(self, n_rows: int, stand_in: int, lockstep: bool = True) -> list[tuple[slice, bool]]:
        """This rank's micro-batches (``trainer.micro_batch_size`` rows) of its
        :func:`row_share` of ``n_rows`` rows as ``(rows, True)``; with ``lockstep``, then
        ``(slice(stand_in, stand_in + 1), False)`` stand-ins up to the largest count of any
        rank, so every rank runs as many forwards (FSDP2 collectives).

        Example: 9 rows, micro-batches of 4, 2 ranks: rank 0 -> ``[(0:4, True), (stand-in,
        False)]``, rank 1 -> ``[(4:8, True), (8:9, True)]``.
        """
        mb = self.cfg.trainer.micro_batch_size
        lo, hi = row_share(n_rows, self.rank, self.world_size)
        mine = [(slice(i, min(i + mb, hi)), True) for i in range(lo, hi, mb)]
        if not lockstep:
            return mine
        most = max(math.ceil((h - lo_) / mb) for lo_, h in
                   (row_share(n_rows, r, self.world_size) for r in range(self.world_size)))
        return mine + [(slice(stand_in, stand_in + 1), False)] * (most - len(mine))

    def _work(self, batch: Batch, model: torch.nn.Module | None = None) -> list[tuple[slice, bool]]:
        """:meth:`row_work` over the batch's rows; the stand-in is its shortest row, and none is
        needed when ``model`` is not sharded (an older version's shadow)."""
        return self.row_work(batch.size, int(batch.lengths.argmin()),
                             _is_sharded(model if model is not None else self.model))

    def _combine_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (each row is filled by its owner only; ``-inf`` + 0 stays ``-inf``)."""
        y = x.to(self.device) if self.device.type == "cuda" else x.clone()
        dist.all_reduce(y)
        return y.cpu()

    def _reduce_losses(self, m: dict[str, float]) -> dict[str, float]:
        """:func:`merge_loss_metrics` over every rank's dict."""
        per_rank: list[Any] = [None] * self.world_size
        dist.all_gather_object(per_rank, m)
        return merge_loss_metrics(per_rank)

    def _routing_metrics(self, batch: Batch, prox: torch.Tensor, noreplay: dict[str, Any]) -> dict[str, float]:
        """The R3 metrics over every rank's rows (each rank recorded the routing of its own)."""
        def merged(used: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            per_rank: list[Any] = [None] * self.world_size
            dist.all_gather_object(per_rank, used)
            return {k: v for d in per_rank for k, v in d.items()}

        self._routing_used = merged(self._routing_used)
        if noreplay:
            noreplay = {**noreplay, "used": merged(noreplay["used"])}
        return super()._routing_metrics(batch, prox, noreplay)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, run_dir, data_cursor: dict[str, Any] | None = None):
        """Every rank: :func:`molt_plugins.distributed.checkpoint.save_sharded_checkpoint` (a
        distributed checkpoint in ``dcp/`` plus the Hugging Face ``model/`` of the full weights)."""
        return save_sharded_checkpoint(self, run_dir, data_cursor)

    # -- weights out ---------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The full policy state dict on rank 0 (CPU tensors, gathered from every shard, a tied
        head one tensor with the embedding: :func:`molt_plugins.distributed.checkpoint.full_state_dict`;
        a collective: every rank must call it); an empty dict on the other ranks."""
        return full_state_dict(self.model)

    def publish(self, engines) -> int:
        """Gather the full weights (every rank calls it) and load them into ``engines`` from
        rank 0; returns the version published."""
        state = self.weights()
        if self.rank == 0:
            for e in engines:
                e.load_weights(state, self.version)
        return self.version


def local_param_bytes(trainer: Trainer) -> dict[str, int]:
    """Bytes this process holds for the policy's parameters and its optimizer state (for a
    sharded trainer: its shards only).

    Returns:
        ``{"params": int, "optimizer": int}``.
    """
    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    seen: set[int] = set()
    params = 0
    for p in trainer.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params += nbytes(p)
    opt = sum(nbytes(v) for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
    return {"params": params, "optimizer": opt}
