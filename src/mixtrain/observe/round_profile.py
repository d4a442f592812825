"""Where a worker's rounds spend their time: with MIXTRAIN_PROFILE_DIR set, each worker runs a few of its
rounds under torch.profiler (CPU, and CUDA where the worker has it) and appends the profiler's table to
DIR/worker-<rank>.txt. A diagnostic for one run (the GPU check's overhead step takes it apart this way), off
by default: unset, a round costs one attribute read more."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from mixtrain._constants import PROFILE_DIR_ENV

PROFILE_DIR = PROFILE_DIR_ENV
SKIP_ROUNDS = 3
"""Rounds run unprofiled first (warm-up: allocator, autotuning, the first epoch's loader)."""
PROFILED_ROUNDS = 3


class RoundProfiler:
    def __init__(self, rank: int) -> None:
        where = os.environ.get(PROFILE_DIR)
        self.file = Path(where) / f"worker-{rank}.txt" if where else None
        self.rounds = 0

    @contextmanager
    def round(self, device: torch.device) -> Iterator[None]:
        index, self.rounds = self.rounds, self.rounds + 1
        if self.file is None or not SKIP_ROUNDS <= index < SKIP_ROUNDS + PROFILED_ROUNDS:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            yield
        wall = time.perf_counter() - t0
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with self.file.open("a") as f:
            f.write(f"# round {index} on {device}: {wall * 1e3:.1f} ms wall\n{table}\n")
