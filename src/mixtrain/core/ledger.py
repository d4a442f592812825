"""A worker's bookkeeping for one round: per-step timings and bytes, and the global results of steps that
arrive later than the step itself (asynchronous strategies). Keeps the step loop free of it."""

from __future__ import annotations

import math
import time
from collections import deque

from mixtrain.comm.strategy import RoundSync, StepOutcome, StepResult
from mixtrain.core.messages import RoundPlan, WorkerReport
from mixtrain.observe import worker_log


class RoundLedger:
    def __init__(self, rank: int) -> None:
        self.report = WorkerReport(rank=rank)
        self._waiting: deque[int] = deque()  # steps whose global result (loss, applied) is not known yet
        self._started = time.perf_counter()

    def step_done(self, step: int, outcome: StepOutcome, seconds: float, samples: int, local_loss: float) -> None:
        """One step of this worker: `seconds` from its start to the strategy's return, communication included."""
        r = self.report
        self._waiting.append(step)
        r.compute_s.append(seconds - outcome.comm_s)
        r.comm_s.append(outcome.comm_s)
        r.staleness.append(outcome.staleness)
        r.sent_bytes += outcome.sent_bytes
        r.samples += samples
        if outcome.grad_norm is not None:
            r.grad_norms.append(outcome.grad_norm)
        self._take(outcome.done)
        if not math.isfinite(local_loss):
            r.nonfinite_steps.append(step)

    def close(
        self, plan: RoundPlan, sync: RoundSync, memory_bytes: int | None, state_bytes: dict[str, int]
    ) -> WorkerReport:
        """The round's end: the last results, the replicas' drift, wall time and memory; logged once."""
        r = self.report
        self._take(sync.done)
        assert not self._waiting, f"steps {list(self._waiting)} ended the round without a result"
        r.sent_bytes += sync.sent_bytes
        r.drift, r.rebroadcast, r.round_comm_s = sync.drift, sync.rebroadcast, sync.comm_s
        r.wall_s = time.perf_counter() - self._started
        r.memory_bytes, r.state_bytes = memory_bytes, state_bytes
        r.committed_steps = self.committed_steps
        worker_log.log.info(
            "epoch %d steps %d-%d: %d samples, %.3f s compute, %.3f s in collectives, %.3f s wall",
            plan.epoch,
            plan.first_step,
            plan.first_step + plan.num_steps - 1,
            r.samples,
            sum(r.compute_s),
            sum(r.comm_s) + r.round_comm_s,
            r.wall_s,
        )
        return r

    @property
    def committed_steps(self) -> int:
        """Steps whose global result this worker has seen (every rank agreed on their update)."""
        return len(self.report.losses)

    def abort(self, peer_lost: str, committed: int) -> WorkerReport:
        """The round failed on a lost peer: what this worker did, and how many steps of it stand."""
        r = self.report
        r.peer_lost, r.committed_steps = peer_lost, committed
        r.wall_s = time.perf_counter() - self._started
        worker_log.log.warning("round failed after %d committed steps: %s", committed, peer_lost)
        return r

    def _take(self, done: list[StepResult]) -> None:
        for result in done:
            step = self._waiting.popleft()
            self.report.losses.append(float(result.stats[0]))
            if not result.applied:
                self.report.skipped_steps.append(step)
