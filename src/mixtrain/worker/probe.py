"""Measuring a device before training: how fast it loads and computes, and the largest micro-batch that fits.

The search takes a function that runs one forward+backward at a given batch size, so it is the
same code on CUDA, MPS and in tests (where a model raises torch.OutOfMemoryError past a size).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


class ProbeError(RuntimeError):
    """The device cannot run even one sample."""


def largest_fitting(
    run: Callable[[int], object],
    start: int,
    limit: int,
    is_oom: Callable[[BaseException], bool],
    after_oom: Callable[[], None] = lambda: None,
) -> int:
    """The largest batch size <= `limit` that `run` survives, found by halving from `start` until one
    fits, then doubling (and bisecting the last gap) up to `limit`. An out-of-memory error is caught
    and cleaned up after (`after_oom`, e.g. emptying the allocator's cache); any other error propagates.
    """
    if limit < 1:
        raise ValueError(f"limit={limit} must be >= 1")

    def fits(batch: int) -> bool:
        try:
            run(batch)
            return True
        except Exception as exc:  # only out-of-memory is expected; the rest is re-raised
            if not is_oom(exc):
                raise
            after_oom()
            return False

    good = min(max(start, 1), limit)
    while not fits(good):
        if good == 1:
            raise ProbeError("out of memory with a micro-batch of 1 sample: the model does not fit on this device")
        good //= 2
    bad = None  # smallest size known not to fit
    while good < limit and bad is None:
        trial = min(good * 2, limit)
        good, bad = (trial, None) if fits(trial) else (good, trial)
    return good if bad is None else _bisect(fits, good, bad)


def _bisect(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """Narrow the gap between a size that fits and one that does not, to within 12.5% (close enough)."""
    while bad - good > max(1, good // 8):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def time_steps(
    run: Callable[[int], object],
    batch: int,
    repeats: int = 5,
    warmup: int = 2,
    min_s: float = 0.3,
    max_repeats: int = 50,
    waited: Callable[[], float] = lambda: 0.0,
) -> float:
    """Median seconds of `run(batch)` after `warmup` untimed calls: at least `repeats` calls and, for
    fast steps, enough of them to fill `min_s` seconds (at most `max_repeats`), so noise averages out.

    `waited`: seconds so far this thread spent runnable but waiting for a core (devices.cpu.CpuShare), taken
    off each call's time. The probe runs once, while other processes start (a peer importing torch, Ray's
    own helpers, another program): what it measures is the device's speed with a core, not that moment's load
    (a 4x slower CPU worker once read as fast as its peer). The rounds measure the load as it lasts."""
    for _ in range(warmup):
        run(batch)
    times: list[float] = []
    while len(times) < max_repeats and (len(times) < repeats or sum(times) < min_s):
        t0, w0 = time.perf_counter(), waited()
        run(batch)
        elapsed = time.perf_counter() - t0
        times.append(max(elapsed - (waited() - w0), 0.01 * elapsed))
    return statistics.median(times)


def samples_per_s(batch: int, compute_s: float, load_s_per_sample: float) -> float:
    """Samples per second of steps of `batch` samples that each load their samples (`load_s_per_sample` seconds
    apiece, measured once) and then compute for `compute_s` (timed on samples read once and reused): the probe
    times the compute on data in memory, so the user's Dataset is not read again for every timed step."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    return batch / (compute_s + load_s_per_sample * batch)
