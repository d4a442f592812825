"""Apple Silicon GPUs through torch.mps. Untested on real hardware: no Mac is available to the
project's CI; the tests patch torch's MPS functions (see docs/what-runs-where.md)."""

from __future__ import annotations

import platform
import subprocess

import torch

from mixtrain.devices.base import DeviceKind


def _chip() -> str:
    """'Apple M2 Pro' from sysctl, or the machine type when sysctl is not there."""
    try:
        out = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=2, check=False
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


class MpsDevice(DeviceKind):
    kind = "mps"
    supports_float64 = False
    has_own_random_stream = True
    # A non-blocking copy to MPS from a CPU tensor that is freed before the stream syncs can land corrupted
    # (pytorch#189690, open; OLMo-core stopped using it): every copy to or from MPS is blocking. The CPU staging
    # of collectives (comm/buckets.py) is blocking as well, so a staged gradient is complete when it is summed.
    non_blocking_copies = False
    # MPS `any`/`all` give wrong answers on one tensor of more than 2**31 - 1 elements (torch 2.13/2.14)
    max_reduce_numel = 2**31 - 1

    def available(self) -> bool:
        return torch.backends.mps.is_available()

    def name(self, index: int = 0) -> str:
        return f"{_chip()} GPU (MPS)"

    def memory(self, index: int = 0) -> tuple[int | None, int | None]:
        # Unified memory: the share Metal recommends for one process, minus what the driver holds.
        total = int(torch.mps.recommended_max_memory())
        return total, max(0, total - int(torch.mps.driver_allocated_memory()))

    def cap_memory(self, cap_bytes: int | None, index: int = 0) -> bool:
        if cap_bytes is None:  # MPS's own limit stays (a kept worker's earlier cap is not lifted: it has no reader)
            return False
        # a fraction of the recommended working set, which MPS takes up to 2.0 (0 would lift every limit)
        fraction = cap_bytes / int(torch.mps.recommended_max_memory())
        torch.mps.set_per_process_memory_fraction(min(2.0, max(fraction, 1e-6)))
        return True

    def memory_in_use(self, index: int = 0) -> int | None:
        return int(torch.mps.driver_allocated_memory())  # what Metal holds for this process, caches included

    def supports_bf16(self, index: int = 0) -> bool:
        try:  # macOS 14+ has bf16 on MPS; older systems raise
            torch.zeros(1, dtype=torch.bfloat16, device="mps")
        except (RuntimeError, TypeError):
            return False
        return True

    def supports_fp16(self, index: int = 0) -> bool:
        return True

    def synchronize(self, index: int = 0) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def rng_state(self, index: int = 0) -> torch.Tensor | None:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int = 0) -> None:
        torch.mps.set_rng_state(state)

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and "MPS backend out of memory" in str(exc)
