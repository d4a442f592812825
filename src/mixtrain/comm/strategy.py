"""How replicas agree after each local backward pass.

The worker's step loop calls only `zero_grad`, `step` and `end_round`; a parameter server
or local SGD is another subclass here, with no change to the loop.
"""

from __future__ import annotations

import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixtrain.comm import replicas
from mixtrain.comm.buckets import GradBuckets
from mixtrain.comm.compress import wire_dtype
from mixtrain.config import StrategyConfig
from mixtrain.devices.precision import LossScale
from mixtrain.task import Task


@dataclass(frozen=True)
class StepResult:
    """The global outcome of one step, the same on every rank."""

    applied: bool
    """False when the summed gradient was not finite and the update was skipped everywhere."""
    stats: torch.Tensor
    """The per-step statistics summed over ranks (the global mean loss at index 0)."""


@dataclass(frozen=True)
class StepOutcome:
    done: list[StepResult]
    """Results of this rank's steps that became known during this call, oldest first: this step's for
    a synchronous strategy; none, or several earlier ones, for one that does not wait."""
    comm_s: float
    """Seconds spent communicating, including waiting for slower peers."""
    sent_bytes: int = 0
    """Bytes of gradients or deltas this rank sent for this step (the wire size)."""
    staleness: int = 0
    """How many updates the weights this step's gradient was computed on were behind the step."""
    grad_norm: float | None = None
    """The gradient's global L2 norm before clipping (None: the task does not clip)."""


@dataclass(frozen=True)
class RoundSync:
    drift: float
    """Largest relative difference of a replica's parameter checksum from rank 0's."""
    rebroadcast: bool
    """True when drift passed the tolerance and rank 0's state was broadcast."""
    comm_s: float
    done: list[StepResult] = field(default_factory=list)
    """Results of steps still outstanding when the round's last step returned."""
    sent_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class JoinContext:
    """What a strategy is set up with when a group forms."""

    bucket_bytes: int
    loss_scaling: bool
    """fp16 somewhere in the job: the same on all ranks."""
    rank: int
    world_size: int
    timeout_s: float
    """How long to wait for peers or parameter servers before the round is given up as failed."""
    servers: tuple[Any, ...] = ()
    """The parameter-server actors (ps, ps-async)."""


def clip_gradients(task: Task, params: list[torch.nn.Parameter]) -> float | None:
    """Clip the (reduced, unscaled) gradient of `params` to the task's max_grad_norm; its norm before.
    Every replica holds the same gradient here, so every replica clips it the same way."""
    if task.max_grad_norm is None:
        return None
    return float(torch.nn.utils.clip_grad_norm_(params, task.max_grad_norm))


def median_seconds(exchange: Callable[[], object], repeats: int) -> float:
    """Median wall time of `exchange` over `repeats` calls, after one warm-up call (measure_comm)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        exchange()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class SyncStrategy(ABC):
    name: str
    loss_scale: LossScale = LossScale(enabled=False)
    """The job-wide loss scale (fp16); the worker multiplies each loss by `loss_scale.scale`."""

    def __init__(self, config: StrategyConfig) -> None:
        self.config = config

    @abstractmethod
    def setup(self, task: Task, ctx: JoinContext) -> None:
        """Called each time the group forms: make every replica equal to rank 0's."""

    @abstractmethod
    def zero_grad(self, task: Task) -> None: ...

    def before_last_backward(self, task: Task) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before the backward of a step's last micro-batch (when gradients become final)."""

    @abstractmethod
    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        """After backward on this rank's samples (`weight`: their part of the step's samples, which the
        gradients are already multiplied by): agree on the update and apply it."""

    @abstractmethod
    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        """Between rounds: finish outstanding work, average buffers (weighted by `weight`, this rank's
        share) and check drift. Afterwards every replica holds the same complete training state."""

    @abstractmethod
    def measure_comm(self, task: Task, repeats: int) -> float:
        """Seconds one exchange takes with no compute in the way (for the planner)."""

    @abstractmethod
    def exchange_bytes(self, task: Task) -> int:
        """Bytes one rank sends per exchange."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own training state (local-sgd's outer momentum) for checkpoints and rollback."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Restore what state_dict() returned."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what setup() attached to the model, before the group is re-formed."""


class AllReduceStrategy(SyncStrategy):
    """Synchronous data parallel: sum of sample-weighted gradients over gloo, then the same step everywhere."""

    name = "allreduce"

    def setup(self, task: Task, ctx: JoinContext) -> None:
        replicas.broadcast_state(task.model)
        self.params = params = [p for p in task.model.parameters() if p.requires_grad]
        # the loss rides along in a spare slot (at the wire precision when compressed)
        self.buckets = GradBuckets(
            params,
            ctx.bucket_bytes,
            num_extras=1,
            comm_device=replicas.comm_device(),
            wire_dtype=wire_dtype(self.config.compress),
        )
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)

    def zero_grad(self, task: Task) -> None:
        self.buckets.zero_()

    def before_last_backward(self, task: Task) -> None:
        self.buckets.arm()  # earlier micro-batches only accumulate; this one may start the all-reduce

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        t0 = time.perf_counter()
        self.buckets.all_reduce_(local_stats)
        comm_s = time.perf_counter() - t0
        applied = self.buckets.all_finite() and bool(torch.isfinite(local_stats).all())
        used = self.loss_scale.scale
        self.loss_scale.update(applied)  # the same verdict on every rank keeps the scales equal
        norm = None
        if applied:
            if used != 1.0:
                self.buckets.scale_(1.0 / used)  # unscale first: the norm is the true gradient's
            norm = clip_gradients(task, self.params)
            task.optimizer.step()
            if task.scheduler is not None:
                task.scheduler.step()
        return StepOutcome(
            done=[StepResult(applied, local_stats)], comm_s=comm_s, sent_bytes=self.buckets.wire_bytes, grad_norm=norm
        )

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        return RoundSync(d, rebroadcast, time.perf_counter() - t0)

    def measure_comm(self, task: Task, repeats: int) -> float:
        def exchange() -> None:
            self.buckets.zero_()
            self.buckets.all_reduce_(torch.zeros(self.buckets.num_extras))

        seconds = median_seconds(exchange, repeats)
        self.buckets.zero_()
        return seconds

    def exchange_bytes(self, task: Task) -> int:
        return self.buckets.wire_bytes

    def close(self) -> None:
        self.buckets.close()
