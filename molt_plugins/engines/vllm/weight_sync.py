"""Weight sync without the driver or Ray's object store in the path: the trainer's rank holding
the full weights broadcasts packed buffers straight into every vLLM worker through one
process group (``engine.weight_sync = "collective"``).

The pattern of vLLM's RLHF examples (``examples/offline_inference/rlhf*.py``), verl and
OpenRLHF: a worker extension (``worker_extension_cls``) adds methods to every vLLM worker,
the engine calls them through ``collective_rpc``, and a process group joins the trainer's
rank 0 (group rank 0) with the vLLM workers (group ranks ``1..``). Unlike those examples the
group is plain ``torch.distributed`` c10d (a ``TCPStore`` and a ``ProcessGroupNCCL`` or
``ProcessGroupGloo`` built directly, outside any default group), so the trainer side does not
import vLLM and the same code runs on CPU (gloo) and GPU (NCCL).

Backend (chosen by the group itself when it forms, no option): NCCL when every member holds
a CUDA device and no two members share one physical GPU (NCCL refuses two ranks on one
device); otherwise gloo, with CUDA buffers staged through host memory (a trainer and an
engine sharing one GPU still sync, at host-copy speed).

One sync (:func:`send_weights` on the trainer, :func:`receive_weights` in each vLLM worker):

1. the sender packs the full state dict into one flat buffer per dtype on its device
   (:func:`molt_core.runtime.weightpack.pack_tensors`, cast to the engine's dtype, padded to
   8 bytes) and broadcasts a header: the policy version, the pack index (name, dtype, shape,
   offset), each buffer's byte count and :func:`~molt_core.runtime.weightpack.buffer_checksum`;
2. it broadcasts each buffer; every receiver receives into a buffer of the announced size on
   its own device (always draining every announced byte, so the group stays in step even when
   the sync is refused);
3. each receiver checks the version against the one its engine was asked to load, each
   buffer's checksum, and the index against the model's checkpoint names and shapes (the
   same check as :meth:`molt_plugins.engines.vllm.engine.VLLMEngine.load_weights`: a skipped or
   extra tensor, or a wrong shape, is refused) -- and only then loads views into the buffers.

A refused sync raises in the engine (the step fails with the reason) and leaves the old
weights and version in place.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch

from molt_core.runtime.weightpack import buffer_checksum, pack_tensors, state_views

__all__ = ["CHECKPOINT_PREFIXES", "EXTENSION", "CollectiveTransport", "SyncGroup", "SyncHeader", "TRANSPORT",
           "WeightSyncExtension", "check_full_state", "checkpoint_name", "choose_backend",
           "free_address", "load_into_worker", "receive_weights", "send_weights"]

#: the ``worker_extension_cls`` qualname the vLLM engine passes to vLLM
EXTENSION = "molt_plugins.engines.vllm.weight_sync.WeightSyncExtension"
_PREFIX = "molt-weight-sync"


def free_address() -> tuple[str, int]:
    """``(ip, port)`` of this host with a TCP port free now: where the sender (group rank 0)
    hosts the group's store. The ip is Ray's node address when Ray runs, else loopback."""
    host = "127.0.0.1"
    try:
        import ray

        if ray.is_initialized():
            host = ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - Ray is a core dependency
        pass
    with socket.socket() as s:
        s.bind(("", 0))
        return host, int(s.getsockname()[1])


def _device_id(device: torch.device) -> str:
    """``cpu`` or the physical GPU's UUID (two ranks on one GPU must not use NCCL)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def choose_backend(device_ids: list[str], nccl_available: bool) -> str:
    """``"nccl"`` when every member is on a GPU (``device_ids``: ``cpu`` or a GPU UUID per
    rank, :func:`_device_id`), no two share one and NCCL is available; else ``"gloo"``."""
    on_gpus = all(i != "cpu" for i in device_ids) and len(set(device_ids)) == len(device_ids)
    return "nccl" if on_gpus and nccl_available else "gloo"


class SyncGroup:
    """One member of the weight-sync process group.

    Args:
        host, port: the store's address (rank 0 hosts it: :func:`free_address` there).
        rank: this member's rank, 0 for the sender.
        world_size: members (1 sender + every vLLM worker of every engine), >= 2.
        device: where this member's buffers live (``cpu`` or ``cuda:i``).
        timeout_s: how long forming the group and each collective may take.

    Attributes:
        backend: ``"nccl"`` or ``"gloo"`` (chosen as the module doc says, the same on every rank).

    Raises:
        ValueError: ``world_size < 2`` or ``rank`` outside ``[0, world_size)``.
        RuntimeError / DistStoreError: a member did not join within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        if world_size < 2:
            raise ValueError(f"a weight-sync group needs a sender and at least one receiver, got world_size {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.rank, self.world_size, self.device = int(rank), int(world_size), torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        self._tcp = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
        store = dist.PrefixStore(_PREFIX, self._tcp)
        self._store, self._seq = store, 0
        store.set(f"device/{rank}", _device_id(self.device))
        ids = [store.get(f"device/{r}").decode() for r in range(world_size)]
        self.backend = choose_backend(ids, dist.is_nccl_available())
        if self.backend == "nccl":
            self._pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size)
        else:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 in place (filled on the other ranks); returns ``t``.
        Gloo with a CUDA tensor goes through a host copy."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        stage = self.backend == "gloo" and t.device.type != "cpu"
        buf = t.cpu() if stage else t
        self._pg.broadcast([buf], opts).wait()
        if stage and self.rank != 0:
            t.copy_(buf)
        return t

    def announce(self, obj: Any = None) -> Any:
        """Hand a picklable object from rank 0 to every rank through the group's store (the
        small header of a sync; one key per call, the previous one deleted); returns it."""
        key = f"announce/{self._seq}"
        if self.rank == 0:
            self._store.set(key, pickle.dumps(obj))
            if self._seq:
                self._store.delete_key(f"announce/{self._seq - 1}")
        else:
            obj = pickle.loads(self._store.get(key))
        self._seq += 1
        return obj

    def close(self) -> None:
        """Leave the group (the store closes when every member dropped it)."""
        self._pg = None


@dataclass(frozen=True)
class SyncHeader:
    """What the sender announces before the buffers of one sync.

    Attributes:
        version: the policy version of these weights.
        index: per name ``(name, dtype name, shape, element offset)`` (see
            :func:`~molt_core.runtime.weightpack.pack_tensors`).
        sizes: dtype name -> buffer bytes (a multiple of 8), in broadcast order.
        checksums: dtype name -> :func:`~molt_core.runtime.weightpack.buffer_checksum`.
    """

    version: int
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]
    sizes: dict[str, int]
    checksums: dict[str, int]

    @property
    def nbytes(self) -> int:
        """Bytes of weight buffers one receiver gets."""
        return sum(self.sizes.values())


#: in-memory state_dict prefix -> the saved checkpoint's (transformers 5 vision-language models
#: nest the language model; their checkpoints on disk do not)
CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_name(name: str, expected: dict[str, Any]) -> str:
    """``name`` as the checkpoint vLLM loaded spells it: a state_dict name of the in-memory
    layout mapped to the saved one (:data:`CHECKPOINT_PREFIXES`) when that one is in
    ``expected`` (name -> shape); unchanged otherwise.

    Example: ``model.language_model.norm.weight`` -> ``model.norm.weight`` when ``expected``
    has the latter."""
    if name in expected:
        return name
    for new, old in CHECKPOINT_PREFIXES:
        if name.startswith(new) and old + name[len(new):] in expected:
            return old + name[len(new):]
    return name


def check_full_state(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                     tied: bool) -> list[str]:
    """The names of ``shapes`` (name -> shape, what a publish carries) to load into a vLLM
    model whose checkpoint has ``expected`` (name -> shape); ``tied``: the model ties
    ``lm_head`` to ``embed_tokens`` (then ``lm_head.weight`` may be given and is skipped).

    vLLM fuses projections (q/k/v, gate/up) and reprocesses a whole layer once all its tensors
    arrived, so a partial update would leave fused layers half-loaded: every checkpoint tensor
    must be given.

    Raises:
        KeyError: a name the checkpoint does not have.
        ValueError: a shape that differs, or checkpoint tensors missing (count and examples).
    """
    names = []
    for name, shape in shapes.items():
        if name == "lm_head.weight" and tied and name not in expected:
            continue  # tied to embed_tokens; vLLM skips it
        if name not in expected:
            raise KeyError(f"load_weights: the model has no parameter named {name!r}")
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(f"load_weights: {name} has shape {tuple(shape)}, the model expects {tuple(expected[name])}")
        names.append(name)
    missing = sorted(set(expected) - set(names))
    if missing:
        raise ValueError(f"load_weights: the vllm engine reloads whole layers; give the full state dict "
                         f"({len(missing)} tensors missing, e.g. {missing[:3]})")
    return names


def send_weights(group: SyncGroup, state: dict[str, torch.Tensor], version: int,
                 dtype: torch.dtype | None = None) -> SyncHeader:
    """Broadcast ``state`` (name -> full tensor, any device) as policy ``version`` to every
    receiver of ``group`` (this process is rank 0). Blocks until every buffer was sent.

    Args:
        dtype: cast floating-point tensors to it before sending (the engine's dtype).

    Returns:
        The :class:`SyncHeader` sent (``header.nbytes``: bytes each receiver got).

    Raises:
        ValueError: called on a rank other than 0.
    """
    if group.rank != 0:
        raise ValueError(f"send_weights runs on the sender (group rank 0), not rank {group.rank}")
    buffers, index = pack_tensors(state, dtype=dtype, pad_to=8, device=group.device)
    header = SyncHeader(int(version), index, {k: int(v.numel()) for k, v in buffers.items()},
                        {k: buffer_checksum(v) for k, v in buffers.items()})
    group.announce(header)
    for dt in header.sizes:
        group.broadcast(buffers[dt])
    return header


def receive_weights(group: SyncGroup, version: int, expected: dict[str, tuple[int, ...]],
                    tied: bool) -> tuple[SyncHeader, list[tuple[str, torch.Tensor]]]:
    """Receive one :func:`send_weights` on a receiver of ``group`` and check it.

    Every announced byte is received before any check, so a refused sync leaves the group in
    step for the next one.

    Args:
        version: the policy version the engine was asked to load.
        expected, tied: the model's checkpoint names -> shapes and whether it ties
            ``lm_head`` (see :func:`check_full_state`).

    Returns:
        ``(header, [(name, tensor view), ...])``: views into the received buffers (on
        ``group.device``), in the sender's order, named as the checkpoint spells them
        (:func:`checkpoint_name`), ready for ``load_weights``.

    Raises:
        ValueError: the header's version is not ``version``; a buffer whose checksum differs
            from the announced one; or the :func:`check_full_state` errors.
        KeyError: a name the model does not have.
    """
    header: SyncHeader = group.announce()
    buffers = {dt: torch.empty(n, dtype=torch.uint8, device=group.device) for dt, n in header.sizes.items()}
    for dt in header.sizes:
        group.broadcast(buffers[dt])
    if header.version != int(version):
        raise ValueError(f"weight sync refused: the trainer sent policy version {header.version}, the engine was "
                         f"asked to load version {version}")
    for dt, buf in buffers.items():
        got = buffer_checksum(buf)
        if got != header.checksums[dt]:
            raise ValueError(f"weight sync refused: the {dt} buffer ({buf.numel()} bytes) has checksum {got}, the "
                             f"trainer sent {header.checksums[dt]} (bytes lost or changed in transit)")
    # the trainer's in-memory names in the checkpoint's spelling, as the Ray path maps them
    # (VLLMEngine.load_weights): a vision-language model's model.language_model.* -> model.*
    names = check_full_state({checkpoint_name(n, expected): s for n, _, s, _ in header.index}, expected, tied)
    views = {checkpoint_name(n, expected): v for n, v in state_views(buffers, header.index).items()}
    return header, [(n, views[n]) for n in names]


def reprocess_tied_lm_head(worker: Any) -> None:
    """Rebuild a tied ``lm_head``'s GEMM kernel after ``reload_weights`` (in a vLLM worker).

    vLLM 0.32's layer-wise reload processes ``embed_tokens`` (which owns the shared weight)
    but reports the tied ``ParallelLMHead`` as "Failed to load weights" and only puts its
    tensor back; on CPU the head's matmul is a oneDNN handle (``layer.cpu_linear``) packed
    from the weight at load, so without this the logits keep using the *old* embedding while
    the input embedding is new. ``process_weights_after_loading`` re-packs it (a no-op off CPU).
    """
    get_model = getattr(getattr(worker, "model_runner", None), "get_model", None)
    head = getattr(get_model(), "lm_head", None) if get_model is not None else None
    method = getattr(head, "quant_method", None)
    if head is not None and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def load_into_worker(worker: Any, named: list[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Load ``named`` (checkpoint name -> tensor, the full set) into a vLLM worker's model.

    vLLM >= 0.1x: ``reload_weights(weights_iterator=...)`` (layer-wise reload: in-place edits
    and ``model.load_weights`` change nothing on CPU, where weights are repacked at load);
    older vLLM: ``model.load_weights(weights=...)``, the RLHF examples' call. A tied
    ``lm_head`` is then re-processed (:func:`reprocess_tied_lm_head`).
    """
    import inspect

    runner_reload = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if runner_reload is not None and "weights_iterator" in inspect.signature(runner_reload).parameters:
        worker.reload_weights(weights_iterator=iter(named))
    else:  # pragma: no cover - older vLLM (GPU)
        worker.model_runner.model.load_weights(weights=named)
    if tied:
        reprocess_tied_lm_head(worker)


def _model_device(worker: Any) -> torch.device:
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") else worker.model_runner.model
    return next(model.parameters()).device


class WeightSyncExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``; vLLM refuses
    names its worker class already has, hence the ``molt_`` prefix). The engine calls them
    through ``collective_rpc``; ``self`` is the vLLM worker (``self.rank``, ``self.model_runner``)."""

    def molt_sync_init(self, host: str, port: int, rank_offset: int, world_size: int, timeout_s: float = 600.0) -> str:
        """Join the weight-sync group as rank ``rank_offset + self.rank``; returns its backend."""
        self._molt_sync = SyncGroup(host, port, rank_offset + int(getattr(self, "rank", 0)), world_size,
                                    _model_device(self), timeout_s)
        return self._molt_sync.backend

    def molt_sync_receive(self, version: int, expected: dict[str, tuple[int, ...]], tied: bool) -> int:
        """Receive, check (:func:`receive_weights`) and load one sync; returns the bytes received.

        Raises:
            RuntimeError: :meth:`molt_sync_init` was not called.
        """
        group = getattr(self, "_molt_sync", None)
        if group is None:
            raise RuntimeError("molt_sync_receive before molt_sync_init: the engine has not joined a weight-sync group")
        header, named = receive_weights(group, version, expected, tied)
        load_into_worker(self, named, tied)
        return header.nbytes

    def molt_load_weights(self, named: list[tuple[str, torch.Tensor]], tied: bool) -> None:
        """Load tensors handed over by the engine (the Ray path): :func:`load_into_worker`."""
        load_into_worker(self, named, tied)


class CollectiveTransport:
    """The ``collective`` weight-sync transport (hook ``molt_register_weight_sync_transports``):
    the calls the kernel's trainer and rollout actors make, mapped onto :class:`SyncGroup`,
    :func:`send_weights` and the vLLM engine's worker extension (:class:`WeightSyncExtension`)."""

    def free_address(self) -> tuple[str, int]:
        """Where the sender hosts the group's store: :func:`free_address`."""
        return free_address()

    def sender(self, host: str, port: int, world_size: int, device: torch.device | str,
               timeout_s: float = 600.0) -> SyncGroup:
        """Join the group at ``host:port`` as its sender (rank 0) on ``device``; blocks until all
        ``world_size`` members joined. The group's ``backend`` is ``"nccl"`` or ``"gloo"``."""
        return SyncGroup(host, port, 0, world_size, device, timeout_s)

    def send(self, group: SyncGroup, state: dict[str, torch.Tensor], version: int,
             dtype: torch.dtype | None = None) -> int:
        """Broadcast ``state`` as policy ``version`` (floats cast to ``dtype``): :func:`send_weights`;
        returns the bytes each receiver got."""
        return send_weights(group, state, version, dtype=dtype).nbytes

    def receivers(self, engine: Any) -> int:
        """Members ``engine`` adds to the group: its vLLM workers (``engine.sync_world_size``)."""
        return int(engine.sync_world_size)

    def join(self, engine: Any, host: str, port: int, rank_offset: int, world_size: int,
             timeout_s: float = 600.0) -> str:
        """Join ``engine``'s workers as ranks ``rank_offset ..``; returns the backend
        (``engine.init_weight_sync``)."""
        return str(engine.init_weight_sync(host, port, rank_offset, world_size, timeout_s))

    def receive(self, engine: Any, version: int) -> int:
        """Receive and load policy ``version`` into ``engine`` between two decode steps
        (``engine.receive_weights``); returns the bytes received.

        Raises:
            ValueError: the engine refused the sync (:func:`receive_weights`).
        """
        return int(engine.receive_weights(version))


#: the transport ``molt_plugins.engines`` registers as ``collective``
TRANSPORT = CollectiveTransport()
