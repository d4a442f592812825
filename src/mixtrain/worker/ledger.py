"""A worker's bookkeeping for one round: per-step timings and bytes, the global results of steps that arrive
later than the step itself (asynchronous strategies), and the bytes the replica holds. Keeps the step loop free
of it.

Losses and gradient norms may be tensors on the worker's device: they are kept as they are and read in one go
when the round ends (or fails), so that the bookkeeping never makes the step loop wait for a GPU."""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from mixtrain.comm.strategy import RoundSync, StepOutcome, StepResult, SyncStrategy
from mixtrain.observe import worker_log
from mixtrain.records.messages import RoundPlan, WorkerReport
from mixtrain.shard.units import held_bytes
from mixtrain.task import Task


class RoundLedger:
    def __init__(self, rank: int) -> None:
        self.report = WorkerReport(rank=rank)
        self._waiting: deque[int] = deque()  # steps whose global result (loss, applied) is not known yet
        self._started = time.perf_counter()
        self._losses: list[torch.Tensor] = []  # global mean loss per committed step, read at the end
        self._local: list[tuple[int, torch.Tensor]] = []  # (step, this worker's loss term), read at the end
        self._norms: list[torch.Tensor | float] = []

    def step_done(
        self, step: int, outcome: StepOutcome, seconds: float, samples: int, local_loss: torch.Tensor
    ) -> None:
        """One step of this worker: `seconds` from its start to the strategy's return, communication included."""
        r = self.report
        self._waiting.append(step)
        r.compute_s.append(seconds - outcome.comm_s)
        r.comm_s.append(outcome.comm_s)
        r.staleness.append(outcome.staleness)
        r.sent_bytes += outcome.sent_bytes
        r.samples += samples
        if outcome.grad_norm is not None:
            self._norms.append(outcome.grad_norm)
        self._take(outcome.done)
        self._local.append((step, local_loss))

    def close(
        self,
        plan: RoundPlan,
        sync: RoundSync,
        memory_bytes: int | None,
        state_bytes: dict[str, int],
        lr: list[float] | None = None,
    ) -> WorkerReport:
        """The round's end: the last results, the replicas' drift, wall time, memory and the learning rates the
        optimizer holds now (per param group); logged once."""
        r = self.report
        r.lr = list(lr or [])
        self._take(sync.done)
        assert not self._waiting, f"steps {list(self._waiting)} ended the round without a result"
        self._read_tensors()
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
        return len(self._losses)

    def take_late(self, done: list[StepResult]) -> None:
        """Results of steps applied before the round stopped part-way (the strategy's flush)."""
        self._take(done)

    def abort(self, peer_lost: str, committed: int) -> WorkerReport:
        """The round failed on a lost peer: what this worker did, and how many steps of it stand. The device may
        be in no state to answer (out of memory, an aborted NCCL communicator): then the losses read as NaN."""
        try:
            self._read_tensors()
        except Exception as exc:  # the failure being reported matters more than its losses
            worker_log.log.warning("could not read this round's losses from the device: %s", exc)
            self.report.losses = [math.nan] * len(self._losses)
            self.report.grad_norms = []
        r = self.report
        r.peer_lost, r.committed_steps = peer_lost, committed
        r.wall_s = time.perf_counter() - self._started
        worker_log.log.warning("round failed after %d committed steps: %s", committed, peer_lost)
        return r

    def _take(self, done: list[StepResult]) -> None:
        for result in done:
            step = self._waiting.popleft()
            self._losses.append(result.stats.reshape(-1)[0])
            if result.grad_norm is not None:
                self._norms.append(result.grad_norm)
            if not result.applied:
                self.report.skipped_steps.append(step)

    def _read_tensors(self) -> None:
        """Losses, local losses and norms as floats in the report (one copy from the device for each kind)."""
        r = self.report
        r.losses = _floats(self._losses)
        r.grad_norms = _floats(self._norms)
        local = _floats([t for _, t in self._local])
        r.nonfinite_steps = [step for (step, _), value in zip(self._local, local) if not math.isfinite(value)]


def learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """The optimizer's learning rate per param group, as floats (a group's lr may be a tensor)."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def state_bytes(task: Task, strategy: SyncStrategy) -> dict[str, int]:
    """What a replica holds, by part: weights (and buffers), gradients, optimizer state, strategy state."""
    model = task.model
    tensors = [*model.parameters(), *model.buffers()]

    # sliced weights: what their storages hold now (0 for another's; a gathered group's views share one)
    weights = held_bytes(tensors) if strategy.slices_weights else sum(t.numel() * t.element_size() for t in tensors)
    return {
        "weights": weights,
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
        **strategy.state_bytes(task),
    }


def _floats(values: list[torch.Tensor] | list[torch.Tensor | float]) -> list[float]:
    """Scalars (tensors on one device or several, or floats) as Python floats, with as few copies as can be."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) == len(values) and values and len({t.device for t in tensors}) == 1:
        return torch.stack([t.reshape(()).float() for t in tensors]).tolist()
    return [float(v) for v in values]
