"""Compressed communication: what gradients and deltas travel as.

bf16 keeps fp32's range with 8 bits of mantissa; fp16 keeps 11 bits but overflows above
65504. Through Ray's object store tensors move as numpy buffers (a pickled torch tensor is
about 10x slower to put and get); numpy has no bfloat16, so bf16 travels as its raw 16 bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(compress: str) -> torch.dtype | None:
    """The dtype a collective runs in, or None for the tensors' own dtype."""
    return WIRE_DTYPES[compress]


def encode(t: torch.Tensor, compress: str) -> np.ndarray:
    """A CPU numpy buffer holding `t` (any float dtype, any device) at the wire precision."""
    dtype = WIRE_DTYPES[compress]
    host = t.detach().to("cpu")
    if dtype is None:
        return host.to(torch.float32).numpy()
    narrow = host.to(dtype)
    return narrow.view(torch.int16).numpy() if dtype == torch.bfloat16 else narrow.numpy()


def decode(a: np.ndarray, compress: str) -> torch.Tensor:
    """The float32 CPU tensor an `encode` buffer stands for. It may share the buffer's memory, which the
    object store hands out read-only: read it, never write to it."""
    with warnings.catch_warnings():  # "the given NumPy array is not writable": nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(a))
    if WIRE_DTYPES[compress] == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(torch.float32)
