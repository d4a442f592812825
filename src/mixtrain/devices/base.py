"""What mixtrain needs to know about one kind of device, in one small interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """One device as a person reads it in `mixtrain devices` and the start-of-run table."""

    kind: str
    index: int
    name: str
    total_memory: int | None
    """Bytes the device has (None where the platform does not tell)."""
    free_memory: int | None
    bf16: bool
    fp16: bool
    uuid: str = ""
    """The physical device's identity where the platform gives one (CUDA's UUID), else empty: two workers
    whose devices share it share one GPU."""

    def as_dict(self) -> dict:
        return asdict(self)


class DeviceKind(ABC):
    """A kind of device (cuda, mps, cpu). Instances are stateless; methods ask torch each time,
    so tests can patch torch's availability functions."""

    kind: str
    supports_float64: bool = True
    """Whether tensors may be float64 here (MPS has no float64: models and data must be float32)."""
    probes_memory: bool = True
    """Whether the start-up probe searches the largest micro-batch that fits (CPU memory is not searched)."""
    has_own_random_stream: bool = False
    """Whether the device has a random stream of its own beside the CPU's (dropout on a GPU)."""
    pins_memory: bool = False
    """Whether the data loader should use page-locked host memory (faster copies to the device)."""
    auto_low_precision: bool = True
    """Whether precision="auto" computes in bf16/fp16 here (the CPU stays fp32: low precision is slower there)."""
    non_blocking_copies: bool = False
    """Whether a host-to-device copy may be non-blocking: worth it, and safe, only into CUDA from pinned memory."""
    max_reduce_numel: int | None = None
    """The most elements one reduction (`any`, `all`, `isfinite(...).all()`) may cover here; None: no limit."""

    @abstractmethod
    def available(self) -> bool: ...

    def count(self) -> int:
        return 1 if self.available() else 0

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device(self.kind, index)

    @abstractmethod
    def name(self, index: int = 0) -> str: ...

    @abstractmethod
    def memory(self, index: int = 0) -> tuple[int | None, int | None]:
        """(total, free) bytes, None where unknown."""

    @abstractmethod
    def supports_bf16(self, index: int = 0) -> bool: ...

    @abstractmethod
    def supports_fp16(self, index: int = 0) -> bool: ...

    def make_current(self, index: int = 0) -> None:  # noqa: B027 - only CUDA has a current device
        """Make this the device that collectives and new allocations use (NCCL needs it)."""

    def synchronize(self, index: int = 0) -> None:  # noqa: B027 - CPU work is synchronous
        """Wait for queued kernels (for honest timings)."""

    def empty_cache(self) -> None:  # noqa: B027 - the CPU allocator keeps no cache to return
        """Give cached, unused memory back to the device (after an out-of-memory error)."""

    def rng_state(self, index: int = 0) -> torch.Tensor | None:
        """This device's own random stream (None: it uses the CPU's)."""
        return None

    def set_rng_state(self, state: torch.Tensor, index: int = 0) -> None:  # noqa: B027 - see rng_state
        """Restore what rng_state returned."""

    @abstractmethod
    def memory_in_use(self, index: int = 0) -> int | None:
        """Bytes this process holds on the device: its peak (CUDA: since the round started; CPU: since the
        process started) or, where no peak is kept, now (MPS). None where the platform does not tell. The
        progress rows and metrics.jsonl show it per round."""

    def reset_peak_memory(self, index: int = 0) -> None:  # noqa: B027 - only CUDA tracks a resettable peak
        """Start a new peak for memory_in_use (called at the start of each round)."""

    @abstractmethod
    def is_oom(self, exc: BaseException) -> bool:
        """True when `exc` is this device's out-of-memory error."""

    def cap_memory(self, cap_bytes: int | None, index: int = 0) -> bool:
        """Hold this process's tensors on the device to `cap_bytes` (DeviceGroup.memory), where the device's allocator
        can: past it, an allocation fails as out-of-memory, which the step's halving of the micro-batch meets. None:
        no cap (a kept worker's next fit). False where nothing can hold a process to a figure (the CPU: the driver
        says when a worker's peak passes it)."""
        return False

    def uuid(self, index: int = 0) -> str:
        """The physical device's identity (see DeviceInfo.uuid); empty where the platform gives none."""
        return ""

    def info(self, index: int = 0) -> DeviceInfo:
        total, free = self.memory(index)
        return DeviceInfo(
            kind=self.kind,
            index=index,
            name=self.name(index),
            total_memory=total,
            free_memory=free,
            bf16=self.supports_bf16(index),
            fp16=self.supports_fp16(index),
            uuid=self.uuid(index),
        )
