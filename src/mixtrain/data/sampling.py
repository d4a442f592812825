"""Step-indexed sharding and shipping datasets to workers.

Epoch e has one seeded permutation of the dataset. Step t's global batch is its slice
[t*B, (t+1)*B); worker i takes the sub-slice after the shares of workers 0..i-1. The last
step of an epoch holds the remaining N mod B samples, split in proportion to the shares,
so every sample is used exactly once per epoch whatever the split. Resuming needs only
(epoch, step).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.policies.planner import shares_for_step

Arrays = tuple[np.ndarray, ...]


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The sample order of one epoch; the same on every process for the same (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return math.ceil(num_samples / global_batch)


def step_size(num_samples: int, global_batch: int, step: int) -> int:
    """Samples in step `step`: the global batch, or what is left for the last step."""
    return min(global_batch, num_samples - step * global_batch)


def worker_indices(perm: np.ndarray, global_batch: int, step: int, shares: Sequence[int], rank: int) -> np.ndarray:
    """Dataset indices that worker `rank` processes at `step` of the epoch ordered by `perm`."""
    size = step_size(len(perm), global_batch, step)
    sizes = shares_for_step(shares, size)
    start = step * global_batch + sum(sizes[:rank])
    return perm[start : start + sizes[rank]]


def to_arrays(data: Any) -> Arrays:
    """A map-style Dataset, a TensorDataset or a tuple of tensors/arrays as a tuple of numpy arrays.

    Every sample is a tuple (inputs..., target). Numpy buffers travel through Ray's object
    store without pickling and come back zero-copy.
    """
    if isinstance(data, (tuple, list)) and data and all(isinstance(x, (torch.Tensor, np.ndarray)) for x in data):
        fields = [x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in data]
    elif isinstance(data, Dataset):
        tensors = getattr(data, "tensors", None)  # TensorDataset: no per-item loop
        if tensors is not None:
            return to_arrays(tuple(tensors))
        num = len(data)  # type: ignore[arg-type]
        if num == 0:
            raise InputValueError("the dataset is empty (len 0): give it at least one sample")
        items = [data[i] for i in range(num)]
        items = [item if isinstance(item, (tuple, list)) else (item,) for item in items]
        fields = [np.stack([np.asarray(item[j]) for item in items]) for j in range(len(items[0]))]
    else:
        raise InputTypeError(
            f"dataset of type {type(data).__name__} is not supported: pass a torch Dataset, a TensorDataset "
            "or a tuple of tensors (inputs..., target)"
        )
    lengths = {len(f) for f in fields}
    if len(lengths) != 1:
        raise InputValueError(
            f"dataset fields have different lengths {sorted(lengths)}; every field needs one row per sample"
        )
    if lengths == {0}:
        raise InputValueError("the dataset is empty (0 samples): give it at least one sample")
    return tuple(fields)


def as_tensors(arrays: Arrays) -> tuple[torch.Tensor, ...]:
    """Zero-copy tensors over (possibly read-only) arrays from the object store; never written to."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return tuple(torch.from_numpy(a) for a in arrays)
