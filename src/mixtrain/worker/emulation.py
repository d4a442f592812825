"""EMULATION, for tests and benchmarks only (off by default): a worker that computes N times slower than its
device, as a slower device would (mixtrain's step loop, or a user's loop through mixtrain.train).
ScalingConfig.emulate_slowdown (or MIXTRAIN_EMULATE_SLOWDOWN=RANK:FACTOR[@ROUND]) asks for it; the worker group then
starts its workers from `slowed(worker_cls, table)`, a subclass that stretches each step's own forward and
backward passes (a GPU's queued kernels included) by sleeping, whatever the load, and whose start-up probe reports
the slower speed. The production worker carries none of it."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any, ClassVar

from mixtrain.config import Slowdown
from mixtrain.records.messages import ProbeResult, RoundPlan, WorkerReport, WorkerSetup


def slowed(base: type, table: Slowdown) -> type:
    """`base` (a TrainWorker class), slowed for the bundles in `table` (starting rank -> (factor, first round));
    `base` itself when the table is empty. The same table gives the same class (kept workers are reused by class)."""
    if not table:
        return base
    return _slowed(base, tuple(sorted(table.items())))


@functools.cache
def _slowed(base: type, table: tuple[tuple[int, tuple[float, int]], ...]) -> type:
    return type(f"Slowed{base.__name__}", (_SlowedMixin, base), {"SLOWDOWN": dict(table)})


class _SlowedMixin:
    SLOWDOWN: ClassVar[Slowdown] = {}
    """Starting rank (bundle) -> (times slower, from the round with this index)."""

    def _setup(self, setup: WorkerSetup) -> None:
        super()._setup(setup)  # type: ignore[misc]
        self._factor, self._from_round = self.SLOWDOWN.get(setup.bundle, (1.0, 0))
        self._slow_now = 1.0

    def probe(self, guess: int, limit: int, memory_cap: int | None = None, forward_only: bool = False) -> ProbeResult:
        """The start-up probe sees the slowdown in force from the first round."""
        result: ProbeResult = super().probe(guess, limit, memory_cap, forward_only)  # type: ignore[misc]
        factor = self._factor if self._from_round == 0 else 1.0
        return replace(result, samples_per_s=result.samples_per_s / max(factor, 1.0))

    def run_round(self, plan: RoundPlan) -> WorkerReport:
        self._slow_now = self._factor if plan.round_index >= self._from_round else 1.0
        report: WorkerReport = super().run_round(plan)  # type: ignore[misc]
        return report

    def _new_session(self, *args: Any) -> Any:
        """A user's loop (LoopWorker): each step's compute stretched the same way, where the loader hands out the
        next batch."""
        session = super()._new_session(*args)  # type: ignore[misc]
        if self._factor > 1.0:
            session.after_compute.append(lambda seconds: time.sleep((self._factor - 1.0) * seconds))
        return session

    def _compute(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = super()._compute(*args)  # type: ignore[misc]
        if self._slow_now > 1.0:
            self.kind.synchronize(self.device.index or 0)  # type: ignore[attr-defined]
            time.sleep((self._slow_now - 1.0) * (time.perf_counter() - t0))
        return out
