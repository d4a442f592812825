"""Training state between processes through Ray's object store, without extra copies.

Ray pickles a torch tensor into a byte string first (a full copy in the sender's heap) and the
receiver unpickles another; a numpy array travels out of band instead: written once into the
object store and read in place (zero-copy) by every process on that node. So tensors cross as
numpy views (`pack`), and the receiver copies only what it keeps (`unpack`): a worker loading
weights copies them into its parameters anyway, a sharded optimizer copies only its slice.
numpy has no bfloat16: those travel as their raw 16 bits with the dtype beside them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Packed:
    """One tensor as a numpy array (bfloat16 as int16 bits) and its torch dtype's name."""

    array: np.ndarray
    dtype: str

    def tensor(self, copy: bool) -> torch.Tensor:
        """The tensor, sharing the (possibly read-only, shared) buffer unless `copy`."""
        with warnings.catch_warnings():  # "the given NumPy array is not writable": copied before any write
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(self.array)
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t.clone() if copy else t


def _pack_tensor(t: torch.Tensor) -> Packed:
    host = t.detach().to("cpu").contiguous()  # out-of-band needs one contiguous buffer
    if host.dtype == torch.bfloat16:
        return Packed(host.view(torch.int16).numpy(), "bfloat16")
    return Packed(host.numpy(), str(host.dtype).removeprefix("torch."))


def pack(obj: Any) -> Any:
    """`obj` (dicts, lists, tuples of tensors and plain values) with every tensor on the CPU as a Packed."""
    if isinstance(obj, torch.Tensor):
        return _pack_tensor(obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any, copy: bool = False) -> Any:
    """The inverse of `pack`; plain tensors pass through. `copy`: own, writable tensors (else views that may
    be read-only: fine to read or to copy from, never to write into)."""
    if isinstance(obj, Packed):
        return obj.tensor(copy)
    if isinstance(obj, dict):
        return {k: unpack(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v, copy) for v in obj)
    return obj


STREAM_CHUNK_BYTES = 64 * 1024 - 1024
"""A streamed state travels in pieces under Ray's inline limit (100 KB): in the replies themselves, never through
the object store, whose pages would stay in the sending worker's resident memory (a second copy of the state)."""


@dataclass(frozen=True)
class _Slot:
    """Where one tensor of a streamed state goes: its place in the byte stream, numpy dtype and shape."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    torch_dtype: str


def stream(obj: Any) -> Iterator[Any]:
    """`obj` as a stream: first its structure with every tensor replaced by a _Slot, then the tensors' bytes in
    pieces of at most STREAM_CHUNK_BYTES. `receive` puts it back together."""
    arrays: list[np.ndarray] = []

    def slot(p: Packed) -> _Slot:
        arrays.append(np.ascontiguousarray(p.array))
        return _Slot(len(arrays) - 1, p.array.dtype.str, tuple(p.array.shape), p.dtype)

    yield _map_packed(pack(obj), slot)
    for array in arrays:
        raw = array.reshape(-1).view(np.uint8)
        for start in range(0, raw.size, STREAM_CHUNK_BYTES):
            yield raw[start : start + STREAM_CHUNK_BYTES].copy()


def receive(pieces: Iterator[Any]) -> Any:
    """The object a `stream` sent (tensors as Packed), from its pieces in order."""
    skeleton = next(pieces)
    slots: list[_Slot] = []

    def note(s: _Slot) -> _Slot:
        slots.append(s)
        return s

    _map_packed(skeleton, note, kind=_Slot)
    buffers = []
    for s in sorted(slots, key=lambda s: s.index):
        buf = np.empty(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize, dtype=np.uint8)
        filled = 0
        while filled < buf.size:
            piece = next(pieces)
            buf[filled : filled + piece.size] = piece
            filled += piece.size
        buffers.append(buf.view(np.dtype(s.dtype)).reshape(s.shape))
    return _map_packed(skeleton, lambda s: Packed(buffers[s.index], s.torch_dtype), kind=_Slot)


def _map_packed(obj: Any, fn: Callable[[Any], Any], kind: type = Packed) -> Any:
    """`obj` with every `kind` leaf replaced by fn(leaf), in a fixed (depth-first) order."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_packed(v, fn, kind) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_packed(v, fn, kind) for v in obj)
    return obj
