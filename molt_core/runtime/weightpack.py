"""One flat buffer for a weight publish: the trainer packs its state dict into a single
contiguous byte array, Ray moves that one array (a numpy array is serialised out of band:
one copy into the object store, a zero-copy read-only view on the receiving side), and the
rollout worker hands the engine views into it.

Why (``benchmarks/bench_sync.py``): a dict of torch tensors is pickled tensor by tensor (each
storage through its own ``torch.save`` stream) and unpickled likewise, which costs far more
than the bytes it moves for a model of many small tensors; and cloning every tensor before
``ray.put`` copies the weights a second time. Tensors that share storage (tied input/output
embeddings) are stored once; every name still maps to its own view, so the receiver copies
into each parameter it has under that name.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["PackedState", "as_state_dict", "pack_state", "unpack_state"]

_ALIGN = 64  # bytes: every tensor starts at a multiple of this offset (any dtype's alignment)


@dataclasses.dataclass(frozen=True)
class PackedState:
    """A state dict as one byte buffer and an index.

    Attributes:
        buffer: ``[nbytes]`` uint8 numpy array holding every distinct tensor's bytes.
        index: per name ``(name, dtype name, shape, byte offset)`` into ``buffer``; names whose
            tensors shared storage (same data pointer, dtype, shape and strides) share an offset.
    """

    buffer: np.ndarray
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes the buffer moves (shared tensors counted once)."""
        return int(self.buffer.nbytes)

    def __len__(self) -> int:
        return len(self.index)


def pack_state(state: dict[str, torch.Tensor]) -> PackedState:
    """Copy ``state`` (name -> tensor, any device and dtype) into one CPU byte buffer.

    One copy per distinct tensor, made here: the result does not alias the live parameters,
    so the caller may step the optimizer while the buffer is in flight.

    Raises:
        TypeError: a value that is not a ``torch.Tensor`` (naming its key).
    """
    seen: dict[tuple, int] = {}
    index: list[tuple[str, str, tuple[int, ...], int]] = []
    todo: list[tuple[torch.Tensor, int]] = []
    total = 0
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pack_state: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        off = seen.get(key)
        if off is None:
            off = seen[key] = total
            todo.append((t, off))
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        index.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), off))
    flat = torch.empty(total, dtype=torch.uint8)
    with torch.no_grad():
        for t, off in todo:
            n = t.numel() * t.element_size()
            if n:
                flat[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach())
    return PackedState(flat.numpy(), tuple(index))


def unpack_state(packed: PackedState) -> dict[str, torch.Tensor]:
    """Name -> tensor views into ``packed.buffer`` (no copy; read them, e.g. ``param.copy_``).

    The buffer Ray hands back is read-only: the views must never be written to.
    """
    with warnings.catch_warnings():  # torch warns that the (read-only) buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(packed.buffer)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off in packed.index:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        out[name] = flat[off:off + n].view(dt).view(shape)
    return out


def as_state_dict(state: Any) -> dict[str, torch.Tensor]:
    """``state`` as a name -> tensor dict: a :class:`PackedState` unpacked, a dict as is."""
    return unpack_state(state) if isinstance(state, PackedState) else state
