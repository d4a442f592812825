"""The pages of Ray's object store that a worker touched, handed back once they add up.

A worker maps the node's object store (one shared file, `/dev/shm/plasma...`) and every page of it the worker
writes (a gradient it pushes to a parameter server) or reads (the weights a shard answers with) stays in the
worker's page tables, and so in its resident memory, until the mapping goes: new objects land at new offsets,
so a worker that exchanges through the store every step collects pages of objects long freed. A ps-async worker
of a 49.9M-parameter MLP held 0.8-0.9 GB of them, a ps worker 0.6 GB, which put its peak 1.23-1.35x over a
torchrun rank's (2026-11-25). The pages belong to the shared file, not to the worker: `madvise(MADV_DONTNEED)` on
a shared mapping only drops them from this process's page tables, and a later read of an object still there
faults its pages back in from the file, unchanged. So once this worker holds more than `limit_bytes` of them
(two exchanges' worth: a store that reuses the offsets of freed objects costs no page faults below that), they
are dropped.

Linux only (it reads /proc/self/maps and /proc/self/status); elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from mixtrain.devices.cpu import status_bytes

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
MIN_LIMIT_BYTES = 32 * 2**20
"""The least `two_steps` sets: below it, too little to be worth the page faults of reading objects again."""


def two_steps(bytes_per_step: int) -> int:
    """The default limit: the store's pages of two steps (or updates) of `bytes_per_step`, at least MIN_LIMIT_BYTES."""
    return max(2 * bytes_per_step, MIN_LIMIT_BYTES)


def store_ranges(maps_text: str) -> list[tuple[int, int]]:
    """(start, end) of the shared mappings of Ray's object store in a /proc/<pid>/maps text."""
    ranges = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "s" in fields[1] and "/plasma" in fields[5]:
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


class StorePages:
    """Drops this process's pages of the object store (`release_if_over`) once they exceed `limit_bytes`."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = int(limit_bytes)
        self.released = 0
        """How many times the pages were dropped."""
        self._ranges: list[tuple[int, int]] = []
        self._libc = ctypes.CDLL(None, use_errno=True) if platform.system() == "Linux" else None

    def release_if_over(self) -> bool:
        """True when the pages were over the limit and were dropped (a read of /proc/self/status, about 30 us,
        when they were not)."""
        if self._libc is None:
            return False
        try:
            with open("/proc/self/status", encoding="ascii", errors="replace") as f:
                held = status_bytes(f.read(), "RssShmem")  # resident shared memory, the store's among it
            if held is None or held <= self.limit_bytes:
                return False
            if not self._ranges:  # the store is mapped at the first object this process touches
                with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                    self._ranges = store_ranges(f.read())
        except OSError:
            return False
        if not self._ranges:  # other shared memory (not the store's) is over the limit: nothing of ours to drop
            return False
        for start, end in self._ranges:
            self._libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
        self.released += 1
        if self.released == 1:
            logging.getLogger("mixtrain.worker").info(
                "the object store's pages this process touched passed %.1f MB (%.1f MB): handed back, as each time "
                "they pass it (MIXTRAIN_STORE_PAGES_MB)",
                self.limit_bytes / 2**20,
                held / 2**20,
            )
        return True
