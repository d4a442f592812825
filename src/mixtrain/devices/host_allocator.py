"""The host allocator of a worker process: blocks of 16 MB and more go back to the system when freed, but
for a step's activations.

glibc's malloc serves a freed large block's size from its heap from then on (its mmap threshold rises
with every large free, up to 32 MB), and a heap keeps what it once held. A worker allocates buffers of
16-32 MB now and then (a state broadcast's pieces, gradient buckets of 25 MB, a parameter server's
answers), and held 150-200 MB it no longer used: on a 12.6M-parameter AdamW MLP its peak was 730-920 MB
against 648-692 MB with a fixed threshold of 16 MB and a trim threshold of 32 (torchrun DDP: 654-682;
600 with a fixed 4 MB threshold).

Blocks at least this large then cost a page fault per 4 KB page each time they are allocated: a step's
activations of 16 MB and more would be mapped, faulted in and unmapped at every step. At 4 MB a small CNN's
steps ran 2x slower; at 16 MB the benchmark's CNN on one worker of 128 samples (activations of 19 MB) ran
at 400-420 ms a step against 273-332 with glibc's own threshold (2026-11-25). So while the model's forward
pass runs (`activations()`), the threshold is glibc's largest, 32 MB (and the trim threshold 64 MB): the
activations come from the heap and are reused at every step, as in a plain PyTorch process, and backward's
temporaries of the same sizes reuse the activations' blocks as it frees them. One CNN worker then ran within
noise of a plain process (`compare.py --runners single1,mixtrain1`: 288 against 296 ms a step). Everything
else still goes back at 16 MB: the exchange's and the optimizer's temporaries (AdamW's are as large as each
weight) too. Holding 32 MB through backward as well kept such blocks in the heap: a worker of the
12.6M-parameter MLP peaked at 845 / 709 MB, against 689 / 670 with the forward only (DDP 658-679).
MIXTRAIN_HOST_MMAP_THRESHOLD_MB sets the threshold; 0 keeps glibc's rising threshold throughout.

That held the forward pass only; a backward pass allocates blocks as large (the activations' gradients, a
convolution's buffers), and at 16 MB those were mapped and faulted in at every step: one CNN worker of 128 samples
ran at 0.66-0.98x a plain process (2026-12-06, benchmarks.md), and a loop worker, whose forward pass had no such
window, the same. What the MLP above kept in its heap at 32 MB through backward were its weights' sizes: the
temporaries of its 21.5 MB weights' gradients and of the optimizer. So the threshold follows the model
(`weights_are`, both doors): when every trainable weight is under the threshold, no step allocates a weight-sized
block of 16 MB or more, and glibc's largest threshold holds through the steps, as in a plain process once its own
has risen (the CNN worker: 0.95-1.14x the plain process; an MLP of 13 MB weights peaked at 583-662 MB against
623-675 before); a weight as large keeps 16 MB outside forward passes.

Sliced state (shard="gradients" or "full", `sliced_state`) churns blocks of 1-16 MB at every pass: each block's
gathered weights and the broadcasts that carry them (allocated inside the forward pass), its gradients and the
buffers that take them to their owners. From the heap, interleaved with activations and the optimizer's state, they
left 300-450 MB free but resident per worker (glibc's mallinfo2: 370-690 MB in use, RSS 1,100-1,330 MB on a
67.3M GPT-2 over 3 CPU workers, benchmarks/sliced.py), and the peak RSS did not follow the slice. So there the
threshold is 1 MB throughout (MIXTRAIN_SLICED_MMAP_THRESHOLD_MB), forward passes included: the peaks fell to
910-1,062 MB (1.02-1.06x the plan), RSS within 50-130 MB of what is in use. The price is a page fault per 4 KB of
every such block: 520,000 a step against 30,000-100,000, and 2.5 CPU s a step against 1.5 there. A threshold of
4 MB (or 1 MB outside the forward pass) faulted 150,000-300,000 a step but kept 1.17-1.20x; a lower one set only
around the gathers, the reduces or the backward pass changed little, for glibc serves a large block from a free
chunk of the heap whatever the threshold, mapping only when none fits. The weights the whole-model build left in
the heap, freed by slicing, go back at once (`trim`). The 10.3M GPT-2 of that benchmark's speed part ran 0.8x
the samples/s it runs with the heap (benchmarks.md).

Linux with glibc only: macOS's allocator returns large blocks on its own; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mixtrain._constants import HOST_MMAP_THRESHOLD_MB, SLICED_MMAP_THRESHOLD_MB, env_float
from mixtrain.errors import InputValueError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MAX_MB = 32  # glibc refuses a larger threshold (HEAP_MAX_SIZE / 2 on 64-bit)


def release_large_blocks() -> bool:
    """Set this process's mmap threshold (MIXTRAIN_HOST_MMAP_THRESHOLD_MB, 16; 0 leaves glibc's default).
    True when set. Read by each worker process, from the environment it starts with."""
    threshold_mb = env_float(HOST_MMAP_THRESHOLD_MB, zero_allowed=True)
    if threshold_mb > MAX_MB:
        name, default = HOST_MMAP_THRESHOLD_MB
        raise InputValueError(
            f"{name}={os.environ[name]!r} is above glibc's limit of {MAX_MB} MB; set it to 0-{MAX_MB} "
            f"(default {default:g})"
        )
    if threshold_mb == 0 or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    global _threshold_mb, _libc
    _threshold_mb, _libc = threshold_mb, ctypes.CDLL(None)
    return _set(threshold_mb)


_threshold_mb = 0.0
"""The threshold set by release_large_blocks (MB; 0: not set, glibc's own)."""
_sliced_mb = 0.0
"""The threshold while the state is sliced (sliced_state; MB; 0: not sliced, _steps_mb or _threshold_mb)."""
_steps_mb = 0.0
"""The threshold for the steps of a model whose weights are all smaller than _threshold_mb (weights_are; MB; 0: a
weight as large, _threshold_mb with activations' 32 in forward passes)."""
_libc: ctypes.CDLL | None = None


def sliced_state(sliced: bool) -> None:
    """A worker's state is sliced (True) from now on, or no longer (False): the threshold for it (see the module's
    docstring), or back to release_large_blocks' own. Nothing where release_large_blocks set nothing."""
    global _sliced_mb
    if not _threshold_mb:
        return
    _sliced_mb = env_float(SLICED_MMAP_THRESHOLD_MB, zero_allowed=True) if sliced else 0.0
    if _sliced_mb > MAX_MB:
        name = SLICED_MMAP_THRESHOLD_MB[0]
        raise InputValueError(f"{name}={_sliced_mb:g} is above glibc's limit of {MAX_MB} MB; set it to 0-{MAX_MB}")
    _set(_in_force())


def weights_are(*models: torch.nn.Module) -> None:
    """`models` are what this worker trains next. When their largest trainable weight is under the threshold,
    the blocks of 16-32 MB its steps allocate are the steps' own (activations, their gradients, convolutions'
    buffers), reused at every step: glibc's largest threshold then holds through the steps (see the module's
    docstring). A weight as large keeps the threshold, and 32 MB in forward passes only. Nothing where
    release_large_blocks set nothing."""
    global _steps_mb
    if not _threshold_mb:
        return
    weights = (p for model in models for p in model.parameters() if p.requires_grad)
    largest_bytes = max((p.numel() * p.element_size() for p in weights), default=0)
    _steps_mb = MAX_MB if largest_bytes < _threshold_mb * 2**20 else 0.0
    _set(_in_force())


def trim() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim): after freeing much at once."""
    if _libc is not None:
        _libc.malloc_trim(0)


@contextmanager
def activations() -> Iterator[None]:
    """A forward pass: blocks up to 32 MB (the activations) stay in the heap for the next step."""
    if not _threshold_mb or _sliced_mb or _steps_mb:
        yield
        return
    _set(MAX_MB)
    try:
        yield
    finally:
        _set(_in_force())


def _in_force() -> float:
    """The threshold outside a forward pass: sliced state's, else the steps' (small weights), else the set one."""
    return _sliced_mb or _steps_mb or _threshold_mb


def _set(threshold_mb: float) -> bool:
    libc, threshold = _libc, int(threshold_mb * 2**20)
    assert libc is not None
    # A fixed mmap threshold also stops glibc raising its trim threshold (128 KB) with it: the heap's free top
    # would go back to the system at nearly every free and fault in again at the next step. Twice the mmap
    # threshold, as glibc's own rule sets it.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold))
