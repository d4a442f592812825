"""What fits where: a model's measured shape (model_shape.py) against devices one may not have, per slicing level.

For every level (none, optimizer, gradients, full; each with the optimizer state on the host or not) and for each
device alone, it says what each device would hold (bytes by part), whether that fits, the largest micro-batch that
fits, the largest model of the same shape (number of blocks) that fits, and a predicted step time: compute (from
the measured FLOPs and a speed per device) plus the link (bytes per step over the given speed) plus the host's
optimizer step when it is offloaded. Then it picks the fastest option that fits and says why in one sentence.

What a worker r holds (W trainable, F frozen, O optimizer state, f_r = its memory / the group's, U the largest
block, R the trainable bytes outside the blocks, A(b) activations at micro-batch b, P the process's own):
    none       W + F + W (grads) + O + A(b) + P
    optimizer  W + F + W + O f_r + A(b) + P + one 16 MB broadcast piece
    gradients  W + F + W f_r + U (grads of the block in backward) + O f_r + A(b) + P
    full       W f_r + F + R + 2U (the block and the prefetched next) + W f_r + U + O f_r + A(b) + P
Offloading the optimizer moves O f_r to the host; on MPS and CPU the host's memory is the device's (unified), so
it frees nothing there. Bytes over the link per step and worker: none 2W (ring all-reduce), optimizer 3W (and a
broadcast of the updated slices), gradients 2W (reduce to owners, broadcast of the updated weights), full 3W (a
gather before forward, one before backward, a reduce of the gradients). The compute and the link are added, not
overlapped: the prediction errs slow.

Pure functions and dataclasses: no torch, no Ray. `plan_memory(shape, devices, link, global_batch)`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mixtrain.errors import InputValueError

if TYPE_CHECKING:
    from mixtrain.policies.model_shape import ModelShape

GIB = 2**30
MIB = 2**20
LEVELS = ("none", "optimizer", "gradients", "full")
"""Least slicing first."""
LINK_FACTOR = {"none": 2, "optimizer": 3, "gradients": 2, "full": 3}
"""Bytes over the link per step and worker, in units of W."""
TFLOPS = {"cuda": 20.0, "mps": 4.0, "cpu": 0.2}
"""ASSUMED training speed per kind when no samples/s is given, in TFLOP/s actually reached (not the peak): a
mid-range card (RTX 3060/4070 class) with fp32/tf32 matmuls, an M1/M2 GPU, a few desktop CPU cores."""
PROCESS_BYTES = {"cuda": 600 * MIB, "mps": 400 * MIB, "cpu": 400 * MIB}
"""A worker's own memory before the model: a CUDA context and cuBLAS workspace (assumed); a Python process with
torch and Ray (measured: ~400 MiB RSS for a CPU worker, docs/memory-and-big-models.md)."""
UNIFIED = ("mps", "cpu")
"""Kinds whose device memory is the host's: offloading the optimizer frees nothing there."""
HOST_STEP_ELEMENTS_PER_S = 5e8
"""ASSUMED: parameter elements per second an AdamW step on the host gets through (torch's foreach AdamW on a few
desktop cores)."""
HOST_COPY_BYTES_PER_S = 12e9
"""ASSUMED: PCIe bytes per second between a CUDA card and the host (gradients down, weights up)."""
BROADCAST_PIECE = 16 * MIB
UNITS = {"kb": 2**10, "kib": 2**10, "mb": MIB, "mib": MIB, "gb": GIB, "gib": GIB, "tb": 2**40, "tib": 2**40, "b": 1}
"""GB means 2**30 bytes, as cards and Macs are sold: a 12 GB card holds 12 GiB."""
LINK_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}


@dataclass(frozen=True)
class Device:
    """A device that may not be here: its kind, its memory, and (optionally) its speed on this model."""

    kind: str
    memory_bytes: int
    samples_per_s: float | None = None
    """Measured or assumed; None: from the model's FLOPs and TFLOPS[kind]."""

    @property
    def label(self) -> str:
        return f"{self.kind}:{gb(self.memory_bytes)}GB"

    def speed(self, shape: ModelShape) -> float:
        """Samples per second on `shape`."""
        if self.samples_per_s is not None:
            return self.samples_per_s
        return TFLOPS[self.kind] * 1e12 / max(shape.flops, 1.0)


def parse_devices(text: str, flag: str = "--devices") -> list[Device]:
    """'cuda:12GB,mps:16GB,cpu:1.25GB' -> Devices. A device may add its speed: 'cuda:12GB@400' (samples/s); 'cpu'
    alone is this machine's memory."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise InputValueError(
            f"{flag} {text!r}: give devices as KIND:MEMORY separated by commas, e.g. cuda:12GB,mps:16GB"
        )
    return [_device(item, text, flag) for item in items]


def _device(item: str, text: str, flag: str) -> Device:
    spec, _, speed = item.partition("@")
    kind, _, memory = spec.partition(":")
    kind = kind.strip().lower()
    if kind not in TFLOPS:
        raise InputValueError(f"{flag} {text!r}: {kind!r} is not a device kind; use cuda, mps or cpu, e.g. cuda:12GB")
    if not memory:
        if kind != "cpu":
            raise InputValueError(f"{flag} {text!r}: {item!r} needs its memory, e.g. {kind}:12GB")
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        memory_bytes = parse_bytes(memory, f"{flag} {text!r}: {item!r}")
    samples_per_s = None
    if speed:
        try:
            samples_per_s = float(speed)
        except ValueError:
            samples_per_s = -1.0
        if not (math.isfinite(samples_per_s) and samples_per_s > 0):
            raise InputValueError(f"{flag} {text!r}: {item!r}: after @ give samples per second > 0, e.g. {spec}@400")
    return Device(kind, memory_bytes, samples_per_s)


def parse_bytes(text: str, where: str) -> int:
    """'12GB', '1.25GB', '512MB', '16GiB' -> bytes (GB and GiB both 2**30)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise InputValueError(f"{where}: {text!r} is not a memory size; give a number > 0 and GB or MB, e.g. 12GB")
    return int(float(match.group(1)) * UNITS[unit])


def parse_link(text: str, flag: str = "--link") -> float:
    """'1gbit', '10gbit', '100mbit' (also Gbps, Mbps) -> bytes per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z/]+)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in LINK_UNITS or float(match.group(1)) <= 0:
        raise InputValueError(f"{flag} {text!r}: give the link's speed in bits per second, e.g. 1gbit, 10gbit, 100mbit")
    return float(match.group(1)) * LINK_UNITS[unit] / 8


@dataclass(frozen=True)
class DevicePlan:
    """One device under one option."""

    device: Device
    fraction: float
    """Its slice of the sliced state (1.0 alone)."""
    parts: dict[str, float]
    """Bytes it holds by part, at micro-batch 1."""
    max_micro_batch: int
    """The largest micro-batch that fits (0: not even 1), at most the global batch."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.max_micro_batch >= 1


@dataclass(frozen=True)
class Option:
    """One way to train: a level, the optimizer on the host or not, on some of the devices."""

    level: str
    offload: bool
    devices: list[DevicePlan]
    compute_s: float
    link_s: float
    host_s: float
    link_bytes: float
    """Per worker and step."""
    max_blocks: int | None
    """The largest number of blocks of this shape that fits every device (micro-batch 1); None: no blocks."""

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.link_s + self.host_s

    @property
    def label(self) -> str:
        host = ", optimizer on host" if self.offload else ""
        if len(self.devices) == 1:
            return f"{self.devices[0].device.label} alone{host}"
        return f"{self.level}{host}"

    def timing(self) -> str:
        parts = [f"{self.compute_s:.3g} s compute"]
        if self.link_s:
            parts.append(f"{self.link_s:.3g} s link")
        if self.host_s:
            parts.append(f"{self.host_s:.3g} s host step")
        return " + ".join(parts)


@dataclass(frozen=True)
class MemoryPlan:
    """Every option, the one picked (None: nothing fits) and why."""

    shape: ModelShape
    link_bytes_per_s: float
    global_batch: int
    options: list[Option]
    pick: Option | None
    reason: str
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        from mixtrain.policies.memory_table import render

        return render(self)


def holding(shape: ModelShape, level: str, offload: bool, fraction: float, micro_batch: int, kind: str) -> dict:
    """Bytes a worker holds by part (see the module's docstring)."""
    w, f, o, u = shape.trainable_bytes, fraction, shape.optimizer_bytes, shape.block_bytes
    sliced = level != "none"
    parts = {
        "weights": w * f if level == "full" else w,
        "frozen": shape.frozen_bytes,
        "grads": w if level in ("none", "optimizer") else w * f + u,
        "optimizer": o * f if sliced else o,
        "gathered": shape.root_bytes + 2 * u if level == "full" else 0,
        "transient": min(BROADCAST_PIECE, w) if level == "optimizer" else 0,
        "activations": shape.activation_bytes(micro_batch),
        "process": PROCESS_BYTES[kind],
    }
    if offload and kind not in UNIFIED:
        parts["optimizer"] = 0
    return {k: float(v) for k, v in parts.items()}


def largest_micro_batch(shape: ModelShape, level: str, offload: bool, fraction: float, device: Device, cap: int) -> int:
    """The largest micro-batch (at most `cap`) whose holding fits the device's memory; 0 when 1 does not."""
    fixed = sum(holding(shape, level, offload, fraction, 0, device.kind).values())
    per_sample = shape.activation_bytes(1) - shape.activation_bytes(0)
    room = device.memory_bytes - fixed
    if room < per_sample or room <= 0:
        return 0
    return cap if per_sample <= 0 else min(cap, int(room // per_sample))


def largest_blocks(
    shape: ModelShape, level: str, offload: bool, devices: Sequence[Device], fractions: Sequence[float]
) -> int | None:
    """The largest number of blocks of `shape` that fits every device at micro-batch 1; None without blocks."""
    if not shape.num_blocks:
        return None

    def fits(n: int) -> bool:
        bigger = shape.scaled(n)
        return all(
            largest_micro_batch(bigger, level, offload, f, d, 1) >= 1 for d, f in zip(devices, fractions, strict=True)
        )

    if not fits(0):
        return 0
    good, bad = 0, 1
    while fits(bad) and bad < 10**7:
        good, bad = bad, bad * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def option(
    shape: ModelShape, level: str, offload: bool, devices: Sequence[Device], link: float, global_batch: int
) -> Option:
    """One option on `devices`: what each holds, the step's time, the largest model of this shape."""
    total_memory = sum(d.memory_bytes for d in devices)
    fractions = [d.memory_bytes / total_memory if level != "none" else 1.0 for d in devices]
    plans = [
        DevicePlan(
            d,
            f,
            holding(shape, level, offload, f, 1, d.kind),
            largest_micro_batch(shape, level, offload, f, d, global_batch),
        )
        for d, f in zip(devices, fractions, strict=True)
    ]
    link_bytes = LINK_FACTOR[level] * shape.trainable_bytes if len(devices) > 1 else 0.0
    return Option(
        level=level,
        offload=offload,
        devices=plans,
        compute_s=global_batch / sum(d.speed(shape) for d in devices),
        link_s=link_bytes / link,
        host_s=max(_host_step_s(shape, p) for p in plans) if offload else 0.0,
        link_bytes=link_bytes,
        max_blocks=largest_blocks(shape, level, offload, devices, fractions),
    )


def _host_step_s(shape: ModelShape, plan: DevicePlan) -> float:
    """The optimizer step on the host for this device's slice, and (CUDA) the copies over PCIe."""
    elements = shape.num_parameters * shape.trainable_bytes / max(shape.trainable_bytes + shape.frozen_bytes, 1)
    seconds = elements * plan.fraction / HOST_STEP_ELEMENTS_PER_S
    if plan.device.kind not in UNIFIED:
        seconds += 2 * shape.trainable_bytes * plan.fraction / HOST_COPY_BYTES_PER_S
    return seconds


def plan_memory(shape: ModelShape, devices: Sequence[Device], link_bytes_per_s: float, global_batch: int) -> MemoryPlan:
    """Every option (each level with and without offload on all `devices`, and each device alone) and the pick:
    the fastest that fits; on a tie the least slicing."""
    if not devices:
        raise InputValueError("devices=[]: give at least one device, e.g. parse_devices('cuda:12GB,mps:16GB')")
    if global_batch < 1:
        raise InputValueError(f"global_batch={global_batch!r}: must be an integer >= 1")
    options: list[Option] = []
    if len(devices) > 1:
        options += [
            option(shape, level, offload, devices, link_bytes_per_s, global_batch)
            for offload in (False, True)
            for level in LEVELS
        ]
    options += [
        option(shape, "none", offload, [d], link_bytes_per_s, global_batch)
        for d in devices
        for offload in (False, True)
    ]
    fitting = [o for o in options if o.fits]
    pick = min(fitting, key=lambda o: o.step_s) if fitting else None
    notes = [] if any(d.kind not in UNIFIED for d in devices) else ["offload frees nothing on MPS and CPU (unified)"]
    return MemoryPlan(
        shape=shape,
        link_bytes_per_s=link_bytes_per_s,
        global_batch=global_batch,
        options=options,
        pick=pick,
        reason=reason(options, pick, link_bytes_per_s),
        notes=notes,
    )


def reason(options: Sequence[Option], pick: Option | None, link: float) -> str:
    """One sentence: why `pick`, with the numbers (or why nothing fits)."""
    if pick is None:
        nearest = min(options, key=lambda o: max(d.total / d.device.memory_bytes for d in o.devices))
        worst = max(nearest.devices, key=lambda d: d.total / d.device.memory_bytes)
        return (
            f"nothing fits: the nearest, {nearest.label}, needs {gb(worst.total)} GB on {worst.device.label} at "
            f"micro-batch 1 ({gb(worst.device.memory_bytes)} GB there); add memory, or train a smaller model"
        )
    group = [o for o in options if len(o.devices) > 1 and o.fits]
    least = group[0] if group else None
    said = f"{pick.label} takes {pick.step_s:.3g} s a step ({pick.timing()})"
    if least is None or least is pick:
        if least is None and len(pick.devices) == 1 and any(len(o.devices) > 1 for o in options):
            return f"no level fits every device; {said}"
        return f"{said}, the fastest that fits"
    over = f"{link * 8 / 1e9:g} Gbit/s"
    moves = f"moves {LINK_FACTOR[least.level]} x {gb(least.link_bytes / LINK_FACTOR[least.level])} GB per step"
    return (
        f"{least.label} on all devices (the least slicing that fits) over {over} {moves} = {least.link_s:.3g} s, "
        f"{least.step_s:.3g} s a step in all, more than {said}"
    )


def gb(value: float) -> str:
    """Bytes as GB (2**30), three digits."""
    return f"{value / GIB:.3g}" if value < 100 * GIB else f"{value / GIB:.0f}"
