"""Measuring a device before training: how fast it loads and computes, the largest micro-batch that fits, and
how far its gradient is from the CPU's (the start-up checks of TrainWorker.probe and .check_numerics).

The search takes a function that runs one forward+backward at a given batch size, so it is the
same code on CUDA, MPS and in tests (where a model raises torch.OutOfMemoryError past a size).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixtrain.data.sources import SampleSource, to_device
from mixtrain.devices import DeviceKind, precision
from mixtrain.devices.cpu import CpuShare
from mixtrain.records.messages import ProbeResult
from mixtrain.task import Task

NUMERICS_TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 6e-2}
"""Relative L2 difference of a device's gradient from the CPU's above which the device is reported."""
MEMORY_MARGIN = 0.85
"""The memory cap is this fraction of the largest micro-batch the probe ran (optimizer state comes later)."""


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
    repeats: int = 3,
    warmup: int = 1,
    min_s: float = 0.15,
    max_repeats: int = 50,
    waited: Callable[[], float] = lambda: 0.0,
) -> float:
    """Median seconds of `run(batch)` after `warmup` untimed calls: at least `repeats` calls and, for
    fast steps, enough of them to fill `min_s` seconds (at most `max_repeats`), so noise averages out. The
    defaults (1 + at least 3 calls, 0.15 s) took the Task door's start-up probe of the CNN benchmark from
    0.53-0.73 s (2 + 5, 0.3 s) to 0.32-0.33 s with the same speeds within 4%; the rounds correct the rest.

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


@dataclass
class DeviceProbe:
    """One replica on its device, measured before the group forms (TrainWorker.probe and .check_numerics)."""

    task: Task
    kind: DeviceKind
    device: torch.device
    precision: str

    def measure(
        self,
        rank: int,
        train: SampleSource,
        guess: int,
        limit: int,
        memory_cap: int | None,
        forward_only: bool,
        after_oom: Callable[[], None],
    ) -> ProbeResult:
        """TrainWorker.probe on the first `guess` samples of `train`, each read once; weights, buffers, gradients
        and random streams are left as they were."""
        model = self.task.model
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        held = train.first(guess)
        cap = memory_cap
        rng_devices = [self.device] if self.kind.has_own_random_stream else []
        with torch.random.fork_rng(devices=rng_devices, device_type=self.device.type):
            if cap is None and self.kind.probes_memory and not forward_only:
                found = largest_fitting(
                    lambda size: self._step(held.batch(size)), guess, limit, self.kind.is_oom, after_oom=after_oom
                )
                # the optimizer's state is not allocated yet and allocators fragment: keep a margin
                cap = None if found >= limit else max(1, int(found * MEMORY_MARGIN))
            batch = min(guess, cap) if cap else guess
            t0 = time.perf_counter()
            samples = held.batch(batch)  # making the batch (collating) is part of loading it
            load_s = held.read_s / len(held.samples) + (time.perf_counter() - t0) / batch
            self.kind.reset_peak_memory(self.device.index or 0)
            core_wait = CpuShare(enabled=self.kind.kind == "cpu")  # time waiting for a core is not the device's
            compute_s = time_steps(lambda _: self._step(samples, forward_only), batch, waited=core_wait.waited_s) * (
                3 if forward_only else 1
            )
            core_wait.close()
            peak = self.kind.memory_in_use(self.device.index or 0)
        train.forget_first()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        model.zero_grad(set_to_none=True)
        return ProbeResult(
            rank=rank,
            samples_per_s=samples_per_s(batch, compute_s, load_s),
            batch=batch,
            memory_cap=cap,
            peak_bytes=peak,
            load_s_per_sample=load_s,
        )

    def _step(self, samples: Any, forward_only: bool = False) -> None:
        """One forward+backward of a batch of training samples (from `first`: read once, collated already)."""
        batch = to_device(samples, self.device)
        model = self.task.model
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(not forward_only), precision.autocast(self.device, self.precision):
            loss = self.task.batch_loss(model, batch).float()
        if not forward_only:
            loss.backward()
        self.kind.synchronize()
        model.zero_grad(set_to_none=True)

    def numerics_error(self, batch: Any) -> float:
        """The gradient of `batch` on this device (at its precision) against the same gradient computed on the CPU
        in fp32: the relative L2 difference."""
        model = self.task.model
        reference = copy.deepcopy(model).to("cpu")
        grads = []
        for m, device, prec in ((reference, torch.device("cpu"), "fp32"), (model, self.device, self.precision)):
            was_training = m.training
            m.eval()  # no dropout, no running-statistics update: the same function on both devices
            m.zero_grad(set_to_none=True)
            with precision.autocast(device, prec):
                loss = self.task.batch_loss(m, to_device(batch, device))
            loss.float().backward()
            grads.append(
                torch.cat([p.grad.detach().to("cpu").float().reshape(-1) for p in m.parameters() if p.grad is not None])
            )
            m.zero_grad(set_to_none=True)
            m.train(was_training)
        ref, mine = grads
        return float((mine - ref).norm() / ref.norm().clamp_min(1e-12))
