"""One flat buffer for a weight publish: the trainer packs its state dict into one contiguous byte array
per dtype (tied tensors once), Ray moves it out of band, and the rollout worker hands the engine views
into it. Why not a dict of tensors: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["PackedState", "as_state_dict", "buffer_checksum", "pack_state", "pack_tensors", "state_views",
           "unpack_state"]

@dataclasses.dataclass(frozen=True)
class PackedState:
    """A state dict as one byte buffer per dtype and an index.

    Attributes:
        buffers: dtype name (``"float32"``, ...) -> ``[nbytes]`` uint8 numpy array, distinct tensors back to back.
        index: per name ``(name, dtype name, shape, element offset)``; tensors that shared storage share an offset.
    """

    buffers: dict[str, np.ndarray]
    index: tuple[tuple[str, str, tuple[int, ...], int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes the buffers move (shared tensors counted once)."""
        return int(sum(b.nbytes for b in self.buffers.values()))

    def __len__(self) -> int:
        return len(self.index)


def pack_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None, pad_to: int = 1,
                 device: torch.device | str | None = None,
                 ) -> tuple[dict[str, torch.Tensor], tuple[tuple[str, str, tuple[int, ...], int], ...]]:
    """Copy ``state`` (name -> tensor) into one flat ``uint8`` torch buffer per dtype (for :func:`pack_state`
    and the collective weight sync).

    Args:
        state: name -> tensor, any device and dtype.
        dtype: cast every floating-point tensor to it first (the engine's dtype); None keeps each one's.
        pad_to: zero-pad each buffer to a multiple of this many bytes (8 for :func:`buffer_checksum`).
        device: where the buffers live; None: the device of the tensors of that dtype.

    Returns:
        ``(buffers, index)`` as :class:`PackedState`'s fields, the buffers torch tensors.

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
            dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
            hit = seen[key] = (str(dt)[6:], sizes.get(dt, 0))  # "torch.float32" -> "float32"
            groups.setdefault(dt, []).append(t.detach().reshape(-1).to(device=device, dtype=dt))
            sizes[dt] = hit[1] + t.numel()
        index.append((name, hit[0], tuple(t.shape), hit[1]))
    buffers: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for dt, ts in groups.items():
            flat = torch.cat(ts).view(torch.uint8)
            pad = -flat.numel() % pad_to
            if pad:
                flat = torch.cat([flat, flat.new_zeros(pad)])
            buffers[str(dt)[6:]] = flat
    return buffers, tuple(index)


def state_views(buffers: dict[str, torch.Tensor], index: tuple[tuple[str, str, tuple[int, ...], int], ...],
                ) -> dict[str, torch.Tensor]:
    """Name -> tensor views into ``buffers`` (no copy): the inverse of :func:`pack_tensors`.
    Raises: ValueError -- an index entry that reaches past the end of its buffer (names the tensor)."""
    typed = {}
    for dt, buf in buffers.items():
        itemsize = torch.empty((), dtype=getattr(torch, dt)).element_size()
        typed[dt] = buf[: buf.numel() - buf.numel() % itemsize].view(getattr(torch, dt))
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off in index:
        n = 1
        for d in shape:
            n *= d
        if off + n > typed[dtype].numel():
            raise ValueError(f"packed weights: {name} ({dtype}, shape {shape}) ends at element {off + n}, past the "
                             f"{typed[dtype].numel()} elements of the {dtype} buffer")
        out[name] = typed[dtype].narrow(0, off, n).view(shape)
    return out


def buffer_checksum(buf: torch.Tensor) -> int:
    """Sum of ``buf`` (uint8, length a multiple of 8) as int64 words modulo 2**64, independent of reduction
    order and device. Detects lost, gained or changed bytes; not a permutation of whole words.

    Raises:
        ValueError: ``buf`` is not uint8 or its length is not a multiple of 8.
    """
    if buf.dtype != torch.uint8 or buf.numel() % 8:
        raise ValueError(f"buffer_checksum needs a uint8 buffer of a multiple of 8 bytes, got {buf.dtype} "
                         f"[{buf.numel()}]; pack it with pad_to=8")
    return int(buf.view(torch.int64).sum()) if buf.numel() else 0


def pack_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> PackedState:
    """Copy ``state`` into one CPU buffer per dtype (``dtype`` as :func:`pack_tensors`); the result does not
    alias the live parameters, so the optimizer may step while it is in flight.

    Raises:
        TypeError: a value that is not a ``torch.Tensor`` (naming its key).
    """
    buffers, index = pack_tensors(state, dtype=dtype, device="cpu")
    return PackedState({k: v.numpy() for k, v in buffers.items()}, index)


def unpack_state(packed: PackedState) -> dict[str, torch.Tensor]:
    """Name -> read-only tensor views into ``packed.buffers`` (no copy; never write to them)."""
    with warnings.catch_warnings():  # torch warns that a (read-only) buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        buffers = {dtype: torch.from_numpy(buf) for dtype, buf in packed.buffers.items()}
    return state_views(buffers, packed.index)


def as_state_dict(state: Any) -> dict[str, torch.Tensor]:
    """``state`` as a name -> tensor dict: a :class:`PackedState` unpacked, a dict as is."""
    return unpack_state(state) if isinstance(state, PackedState) else state
