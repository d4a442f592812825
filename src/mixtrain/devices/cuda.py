"""NVIDIA GPUs through torch.cuda."""

from __future__ import annotations

import torch

from mixtrain.devices.base import DeviceKind


class CudaDevice(DeviceKind):
    kind = "cuda"
    has_own_random_stream = True
    pins_memory = True
    non_blocking_copies = True

    def available(self) -> bool:
        return torch.cuda.is_available()

    def count(self) -> int:
        return torch.cuda.device_count() if self.available() else 0

    def name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def cap_memory(self, cap_bytes: int | None, index: int = 0) -> bool:
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (cap_bytes or total) / total), index)
        return True

    def uuid(self, index: int = 0) -> str:
        # the same card seen from two processes (Ray gives each half a GPU) has one UUID; NCCL refuses that pair
        return str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")

    def memory(self, index: int = 0) -> tuple[int | None, int | None]:
        free, total = torch.cuda.mem_get_info(index)
        return int(total), int(free)

    def memory_in_use(self, index: int = 0) -> int | None:
        """The round's peak of tensor memory (reset at each round start), the figure that runs out first."""
        return int(torch.cuda.max_memory_allocated(index))

    def reset_peak_memory(self, index: int = 0) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def supports_bf16(self, index: int = 0) -> bool:
        # Ampere (compute capability 8.0) and newer run bf16 natively.
        return torch.cuda.get_device_capability(index)[0] >= 8

    def supports_fp16(self, index: int = 0) -> bool:
        return True

    def make_current(self, index: int = 0) -> None:
        torch.cuda.set_device(index)

    def synchronize(self, index: int = 0) -> None:
        torch.cuda.synchronize(index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def rng_state(self, index: int = 0) -> torch.Tensor | None:
        return torch.cuda.get_rng_state(index)

    def set_rng_state(self, state: torch.Tensor, index: int = 0) -> None:
        torch.cuda.set_rng_state(state, index)

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(exc)
