"""The host CPU: always there, fp32 by default."""

from __future__ import annotations

import os
import platform

import torch

from mixtrain.devices.base import DeviceKind


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def status_bytes(status_text: str, field: str) -> int | None:
    """A field of a /proc/<pid>/status text given in kB ("VmHWM", "RssShmem", ...), in bytes; None if absent."""
    for line in status_text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _peak_rss() -> int | None:
    """VmHWM from /proc/self/status (not ru_maxrss, which a child inherits from its parent across exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return status_bytes(f.read(), "VmHWM")
    except OSError:
        return None


SCHEDSTAT = "/proc/thread-self/schedstat"
"""Linux: a thread's nanoseconds on a CPU, nanoseconds runnable but waiting for one, and its time slices."""


def run_and_wait_ns(fd: int) -> tuple[int, int] | None:
    """A thread's nanoseconds on a CPU and waiting, runnable, for one (Linux schedstat), from `fd`: SCHEDSTAT
    opened by that thread and kept (a read costs about 1 us instead of 18 us for opening the file each time).
    Only waiting for a core counts: a thread asleep or blocked on I/O adds to neither."""
    try:
        on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return None


class CpuShare:
    """The CPU share this thread gets over the windows it measures (start/stop): time on a core over time on
    one or waiting for one. 1.0: a core whenever it could run; 0.5: a busy machine gave it half. None where
    Linux's schedstat is missing (macOS, Windows) or when not `enabled` (nothing is read then)."""

    def __init__(self, enabled: bool = True) -> None:
        self._ran = self._waited = 0
        self._start: tuple[int, int] | None = None
        self._fd: int | None = None
        if enabled:
            try:
                self._fd = os.open(SCHEDSTAT, os.O_RDONLY)
            except OSError:
                pass

    def start(self) -> None:
        if self._fd is not None:
            self._start = run_and_wait_ns(self._fd)

    def stop(self) -> None:
        if self._fd is None or self._start is None:
            return
        end = run_and_wait_ns(self._fd)
        if end is not None:
            self._ran += end[0] - self._start[0]
            self._waited += end[1] - self._start[1]

    def waited_s(self) -> float:
        """This thread's seconds so far runnable but waiting for a core (0.0 where that is not measured)."""
        now = run_and_wait_ns(self._fd) if self._fd is not None else None
        return now[1] / 1e9 if now is not None else 0.0

    def close(self) -> tuple[float, float] | None:
        """(the share, the seconds spent waiting for a core) over every window measured; stops measuring."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        total = self._ran + self._waited
        return (self._ran / total, self._waited / 1e9) if total > 0 else None


class CpuDevice(DeviceKind):
    kind = "cpu"
    probes_memory = False
    auto_low_precision = False

    def available(self) -> bool:
        return True

    def torch_device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")

    def name(self, index: int = 0) -> str:
        return f"{_cpu_name()} ({os.cpu_count()} cores)"

    def memory(self, index: int = 0) -> tuple[int | None, int | None]:
        try:
            import psutil  # a dependency of ray[default]

            mem = psutil.virtual_memory()
            return int(mem.total), int(mem.available)
        except ImportError:
            return None, None

    def memory_in_use(self, index: int = 0) -> int | None:
        """The process's peak resident set so far (Linux; elsewhere the resident set now): model, optimizer
        state, activations, the Python heap, and object-store pages this process wrote or read."""
        peak = _peak_rss()
        if peak is not None:
            return peak
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:
            return None

    def supports_bf16(self, index: int = 0) -> bool:
        return True  # autocast on CPU runs bf16 (slowly where the CPU lacks AVX512-BF16/AMX)

    def supports_fp16(self, index: int = 0) -> bool:
        return False  # fp16 kernels on CPU are slow and patchy: not offered

    def is_oom(self, exc: BaseException) -> bool:
        # torch.OutOfMemoryError: what a user's code raises for "no room" (and what a test raises to act as a GPU)
        oom = isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        return oom or "DefaultCPUAllocator: can't allocate memory" in str(exc)
