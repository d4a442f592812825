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
