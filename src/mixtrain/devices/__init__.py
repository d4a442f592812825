"""Device kinds and the one place that decides which device a worker uses.

from mixtrain import devices
devices.local_devices()        # every device on this machine, as DeviceInfo
devices.resolve("gpu")         # where a worker that asked for a GPU actually runs
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mixtrain.devices.base import DeviceInfo, DeviceKind
from mixtrain.devices.cpu import CpuDevice
from mixtrain.devices.cuda import CudaDevice
from mixtrain.devices.mps import MpsDevice
from mixtrain.errors import InputValueError

KINDS: dict[str, DeviceKind] = {"cuda": CudaDevice(), "mps": MpsDevice(), "cpu": CpuDevice()}
DETECT_ORDER = ("cuda", "mps", "cpu")
"""The auto-detect order: the first kind available wins."""
REQUESTS = ("auto", "gpu", *KINDS)
"""What a worker may ask for: "gpu" means CUDA or Apple, whichever the node has."""


class DeviceUnavailableError(RuntimeError):
    """A worker asked for a kind of device that the node it landed on does not have."""


def get(kind: str) -> DeviceKind:
    if kind not in KINDS:
        raise InputValueError(f"device kind {kind!r}: use one of {', '.join(KINDS)}")
    return KINDS[kind]


def detect() -> str:
    """The best kind on this machine, in DETECT_ORDER."""
    return next(k for k in DETECT_ORDER if KINDS[k].available())


def resolve(request: str) -> DeviceKind:
    """The device kind for a worker that asked for `request` (one of REQUESTS), where it runs.

    Ray 2.60 exposes an Apple GPU as a "GPU" resource, so "gpu" may land on a Mac: CUDA if
    present, else MPS. The index is always 0: Ray restricts CUDA_VISIBLE_DEVICES to the GPU
    it assigned, and a Mac has one GPU.
    """
    if request == "auto":
        return KINDS[detect()]
    if request == "gpu":
        for kind in ("cuda", "mps"):
            if KINDS[kind].available():
                return KINDS[kind]
        raise DeviceUnavailableError(
            "this worker asked for a GPU but neither CUDA nor MPS is available on its node "
            "(torch built without CUDA, or the driver is missing); check `mixtrain devices` on that node"
        )
    found = get(request)
    if not found.available():
        raise DeviceUnavailableError(
            f"this worker asked for a {request} device but torch on its node reports none; "
            "check `mixtrain devices` on that node"
        )
    return found


def local_devices() -> list[DeviceInfo]:
    """Every device this machine offers, GPUs first, the CPU last."""
    out: list[DeviceInfo] = []
    for kind in DETECT_ORDER:
        dev = KINDS[kind]
        out.extend(dev.info(i) for i in range(dev.count()))
    return out


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no tensor holds a NaN or an Inf. Each check covers at most the device's max_reduce_numel
    elements (MPS reductions are wrong past 2**31 - 1), so a large tensor is checked in slices."""
    for t in tensors:
        kind = KINDS.get(t.device.type)
        limit = kind.max_reduce_numel if kind is not None else None
        flat = t.detach().reshape(-1)
        step = limit or max(flat.numel(), 1)
        if not all(bool(torch.isfinite(flat[i : i + step]).all()) for i in range(0, flat.numel(), step)):
            return False
    return True


__all__ = [
    "DETECT_ORDER",
    "KINDS",
    "REQUESTS",
    "DeviceInfo",
    "DeviceKind",
    "DeviceUnavailableError",
    "all_finite",
    "detect",
    "get",
    "local_devices",
    "resolve",
]
