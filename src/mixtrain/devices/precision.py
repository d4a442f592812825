"""Precision per device kind, and one loss scale shared by every rank.

Policy for precision="auto" (DESIGN.md): CUDA bf16 where the GPU has it, else fp16;
MPS bf16 where macOS has it, else fp16; CPU fp32. "fp32", "bf16" and "fp16" ask for one
precision everywhere; a device that lacks it falls back (fp16 -> fp32 on CPU, bf16 -> fp16
on an old GPU) and the start-of-run table says so. Low precision means autocast: weights,
gradients and optimizer state stay fp32, so the all-reduce sums fp32 on every device.

fp16 needs loss scaling. Each rank's local GradScaler would pick its own scale, and gradients
scaled differently cannot be summed, so there is one scale for the job: every rank starts
from the same value and updates it from the same global "all finite?" verdict, so the scales
never diverge without any extra communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mixtrain.config import PRECISIONS
from mixtrain.errors import InputValueError

__all__ = ["PRECISIONS", "LossScale", "autocast", "choose"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def choose(requested: str, kind: str, bf16: bool, fp16: bool) -> str:
    """The precision a device of `kind` runs for the user's `requested` precision."""
    if requested not in PRECISIONS:
        raise InputValueError(f"precision={requested!r}: use one of {', '.join(PRECISIONS)}")
    from mixtrain.devices import get

    if requested == "fp32" or (requested == "auto" and not get(kind).auto_low_precision):
        return "fp32"
    if requested in ("auto", "bf16"):
        if bf16:
            return "bf16"
        return "fp16" if fp16 else "fp32"
    return "fp16" if fp16 else "fp32"


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Autocast for bf16/fp16; nothing for fp32."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_DTYPES[precision]):
        yield


class LossScale:
    """A dynamic loss scale that is identical on every rank (see the module docstring)."""

    def __init__(self, enabled: bool, init: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init if enabled else 1.0
        self.growth_interval = growth_interval
        self._good_steps = 0

    def update(self, applied: bool) -> None:
        """After each step, from the global verdict: halve on overflow, double after a run of good steps."""
        if not self.enabled:
            return
        if not applied:
            self.scale = max(self.scale / 2.0, 1.0)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= 2.0
            self._good_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
