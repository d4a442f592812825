"""How replicas agree after each local backward pass.

The worker's step loop calls only `zero_grad`, `step` and `end_round`; a parameter server
or local SGD is another subclass here, with no change to the loop.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from mixtrain.comm import replicas
from mixtrain.comm.buckets import GradBuckets
from mixtrain.precision import LossScale
from mixtrain.task import Task


@dataclass(frozen=True)
class StepOutcome:
    applied: bool
    """False when the summed gradient was not finite and every rank skipped the update."""
    stats: torch.Tensor
    """The per-step statistics summed over ranks (the global mean loss at index 0)."""
    comm_s: float
    """Seconds spent in collectives, including waiting for slower peers."""


@dataclass(frozen=True)
class RoundSync:
    drift: float
    """Largest relative difference of a replica's parameter checksum from rank 0's."""
    rebroadcast: bool
    """True when drift passed the tolerance and rank 0's state was broadcast."""
    comm_s: float


class SyncStrategy(ABC):
    name: str
    loss_scale: LossScale = LossScale(enabled=False)
    """The job-wide loss scale (fp16); the worker multiplies each loss by `loss_scale.scale`."""

    @abstractmethod
    def setup(self, task: Task, bucket_bytes: int, loss_scaling: bool = False) -> None:
        """Called once when the replica exists and the group is formed; `loss_scaling` is the same on all ranks."""

    @abstractmethod
    def zero_grad(self, task: Task) -> None: ...

    def before_last_backward(self, task: Task) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before the backward of a step's last micro-batch (when gradients become final)."""

    @abstractmethod
    def step(self, task: Task, local_stats: torch.Tensor) -> StepOutcome:
        """After backward on this rank's samples: agree on the update and apply it."""

    @abstractmethod
    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        """Between rounds: average buffers (weighted by `weight`, this rank's share) and check drift."""

    @abstractmethod
    def measure_comm(self, task: Task, repeats: int) -> float:
        """Seconds one step's communication takes with no compute in the way (for the planner)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what setup() attached to the model, before the group is re-formed."""


class AllReduceStrategy(SyncStrategy):
    """Synchronous data parallel: sum of sample-weighted gradients over gloo, then the same step everywhere."""

    name = "allreduce"

    def setup(self, task: Task, bucket_bytes: int, loss_scaling: bool = False) -> None:
        replicas.broadcast_state(task.model)
        params = [p for p in task.model.parameters() if p.requires_grad]
        # the loss rides along in a spare slot
        self.buckets = GradBuckets(params, bucket_bytes, num_extras=1, comm_device=replicas.comm_device())
        self.loss_scale = LossScale(enabled=loss_scaling)

    def zero_grad(self, task: Task) -> None:
        self.buckets.zero_()

    def before_last_backward(self, task: Task) -> None:
        self.buckets.arm()  # earlier micro-batches only accumulate; this one may start the all-reduce

    def step(self, task: Task, local_stats: torch.Tensor) -> StepOutcome:
        t0 = time.perf_counter()
        self.buckets.all_reduce_(local_stats)
        comm_s = time.perf_counter() - t0
        applied = self.buckets.all_finite() and bool(torch.isfinite(local_stats).all())
        used = self.loss_scale.scale
        self.loss_scale.update(applied)  # the same verdict on every rank keeps the scales equal
        if applied:
            if used != 1.0:
                self.buckets.scale_(1.0 / used)
            task.optimizer.step()
            if task.scheduler is not None:
                task.scheduler.step()
        return StepOutcome(applied, local_stats, comm_s)

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        return RoundSync(d, rebroadcast, time.perf_counter() - t0)

    def measure_comm(self, task: Task, repeats: int) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            self.buckets.zero_()
            t0 = time.perf_counter()
            self.buckets.all_reduce_(torch.zeros(self.buckets.num_extras))
            times.append(time.perf_counter() - t0)
        self.buckets.zero_()
        return statistics.median(times[1:])

    def close(self) -> None:
        self.buckets.close()


STRATEGIES: dict[str, type[SyncStrategy]] = {AllReduceStrategy.name: AllReduceStrategy}
