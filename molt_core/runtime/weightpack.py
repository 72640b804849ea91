"""One flat buffer for a weight publish: the trainer packs its state dict into a single
contiguous byte array (one per dtype), Ray moves that one array (a numpy array is serialised out of band:
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

@dataclasses.dataclass(frozen=True)
class PackedState:
    """A state dict as one byte buffer per dtype and an index.

    Attributes:
        buffers: dtype name (``"float32"``, ``"bfloat16"``, ...) -> ``[nbytes]`` uint8 numpy
            array holding every distinct tensor of that dtype, flattened, back to back.
        index: per name ``(name, dtype name, shape, element offset)`` into that dtype's buffer;
            names whose tensors shared storage (same data pointer, dtype, shape and strides)
            share an offset.
    """

    buffers: dict[str, np.ndarray]
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers move (shared tensors counted once)."""
        return int(sum(b.nbytes for b in self.buffers.values()))

    def __len__(self) -> int:
        return len(self.index)


def pack_state(state: dict[str, torch.Tensor]) -> PackedState:
    """Copy ``state`` (name -> tensor, any device and dtype) into one CPU buffer per dtype.

    One copy per distinct tensor, made here (one ``torch.cat`` per dtype): the result does not
    alias the live parameters, so the caller may step the optimizer while it is in flight.

    Raises:
        TypeError: a value that is not a ``torch.Tensor`` (naming its key).
    """
    seen: dict[tuple, tuple[str, int]] = {}
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    index: list[tuple[str, str, tuple[int, ...], int]] = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"pack_state: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        key = (t.device, t.data_ptr(), t.dtype, t.shape, t.stride())
        hit = seen.get(key)
        if hit is None:
            dt = t.dtype
            hit = seen[key] = (str(dt)[6:], sizes.get(dt, 0))  # "torch.float32" -> "float32"
            groups.setdefault(dt, []).append(t.detach().reshape(-1))
            sizes[dt] = hit[1] + t.numel()
        index.append((name, hit[0], tuple(t.shape), hit[1]))
    buffers = {}
    with torch.no_grad():
        for dt, ts in groups.items():
            flat = torch.cat(ts).cpu() if ts[0].device.type != "cpu" else torch.cat(ts)
            buffers[str(dt)[6:]] = flat.view(torch.uint8).numpy()
    return PackedState(buffers, tuple(index))


def unpack_state(packed: PackedState) -> dict[str, torch.Tensor]:
    """Name -> tensor views into ``packed.buffers`` (no copy; read them, e.g. ``param.copy_``).

    The buffers Ray hands back are read-only: the views must never be written to.
    """
    typed: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # torch warns that a (read-only) buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        for dtype, buf in packed.buffers.items():
            typed[dtype] = torch.from_numpy(buf).view(getattr(torch, dtype))
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off in packed.index:
        n = 1
        for d in shape:
            n *= d
        out[name] = typed[dtype].narrow(0, off, n).view(shape)
    return out


def as_state_dict(state: Any) -> dict[str, torch.Tensor]:
    """``state`` as a name -> tensor dict: a :class:`PackedState` unpacked, a dict as is."""
    return unpack_state(state) if isinstance(state, PackedState) else state
