"""Local SGD with DiLoCo's outer optimizer: H local steps per worker, then one average of deltas.

Each worker steps its own copy of the user's optimizer (the inner optimizer) on the mean
gradient of its own samples. Every `local_steps` steps the workers all-reduce their parameter
deltas from the last common point, weighted by their share of the samples, and every rank
applies the average as a gradient to that common point with SGD + Nesterov momentum (DiLoCo:
lr 0.7, momentum 0.9). One collective per H steps instead of one per step. A round always
ends with an exchange, so replicas are equal at every round boundary (checkpoints, workers
leaving and joining work as with all-reduce); the controller sizes rounds in whole multiples of H
(RunSettings.steps_per_exchange), so that exchange is never an early one, but at an epoch's end.
Inner optimizer states stay per worker; a checkpoint keeps rank 0's.

With `compress` int8 or int4 the deltas travel quantized (a scale per 256 values) with error feedback
(compress.ErrorFeedback), through an all-gather: every rank sums every rank's dequantized delta in rank
order, so the replicas stay equal bit for bit.

A step is committed at the exchange that averages it. When a peer is lost mid-round, a worker
goes back to its common point (the weights, scheduler position and loss scale of its last
exchange) and the steps since are redone; its inner optimizer state keeps what those steps
added (local SGD makes no exactness promise; the common point is exact).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from mixtrain import devices
from mixtrain.comm import replicas
from mixtrain.comm.compress import QUANTIZED_BITS, ErrorFeedback, dequantize, quantized_nbytes, wire_dtype
from mixtrain.comm.strategy import (
    JoinContext,
    RoundSync,
    StepOutcome,
    StepResult,
    SyncStrategy,
    clip_gradients,
    load_small_state,
    median_seconds,
    small_state,
    tensor_bytes,
)
from mixtrain.devices.precision import LossScale
from mixtrain.task import Task


class LocalSGDStrategy(SyncStrategy):
    name = "local-sgd"
    momentum: torch.Tensor = torch.zeros(0)
    """The outer optimizer's momentum buffer (the same on every rank); kept across re-formed groups."""

    def setup(self, task: Task, ctx: JoinContext) -> None:
        replicas.broadcast_state(task.model)
        self.params = [p for p in task.model.parameters() if p.requires_grad]
        self.anchor = self._flat_params()  # the last common point, on the CPU in fp32
        if self.momentum.numel() != self.anchor.numel():  # first set-up (a re-formed group keeps it)
            self.momentum = torch.zeros_like(self.anchor)
        self._work = torch.zeros(self.anchor.numel() + 2 * self.config.local_steps)  # the exchange's one buffer
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)
        bits = QUANTIZED_BITS.get(self.config.compress)
        self.wire = torch.float32 if bits else (wire_dtype(self.config.compress) or torch.float32)
        self.feedback = ErrorFeedback(bits) if bits else None  # int8/int4 deltas: an all-gather, not a sum
        self._pending: list[torch.Tensor] = []  # per step since the last exchange: [loss term, non-finite]
        self._weights: list[float] = []
        self._committed: dict[str, Any] = {}  # scheduler and loss scale at the last exchange

    def begin_round(self, task: Task) -> None:
        self._committed = small_state(task, self.loss_scale)  # a round starts at a common point

    def recover(self, task: Task) -> None:
        replicas.unflatten_into(self.anchor, self.params)
        if self.feedback is not None:  # the residual of a delta no survivor applied
            self.feedback.reset()
        load_small_state(task, self.loss_scale, self._committed)
        self._pending, self._weights = [], []

    def _flat_params(self) -> torch.Tensor:
        return replicas.flat_on_host(self.params, torch.float32)

    def zero_grad(self, task: Task) -> None:
        task.model.zero_grad(set_to_none=True)

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = None
        finite = devices.all_finite([*grads, local_stats])  # on the device: MPS checks in slices of < 2**31
        if weight > 0:
            if finite:
                factor = 1.0 / (weight * self.loss_scale.scale)  # this rank's own mean gradient
                for g in grads:
                    g.mul_(factor)
                norm = clip_gradients(task, self.params)  # this worker's own mean gradient (local SGD)
                task.optimizer.step()
                if task.scheduler is not None:
                    task.scheduler.step()
            self.loss_scale.update(finite)
        self._pending.append(torch.cat([local_stats.float().reshape(-1), torch.tensor([0.0 if finite else 1.0])]))
        self._weights.append(weight)
        if len(self._pending) < self.config.local_steps:
            return StepOutcome(done=[], comm_s=0.0, grad_norm=norm)
        t0 = time.perf_counter()
        done, sent = self._exchange(task)
        return StepOutcome(done=done, comm_s=time.perf_counter() - t0, sent_bytes=sent, grad_norm=norm)

    def _exchange(self, task: Task) -> tuple[list[StepResult], int]:
        """Average the weighted deltas and the pending per-step statistics in one collective, then
        apply the outer step to the common point. Everything happens in one reused fp32 buffer: no
        temporary as large as the model besides a narrower wire copy when compressing."""
        share = sum(self._weights) / len(self._weights)  # this rank's part of the samples since the last exchange
        n, k = self.anchor.numel(), len(self._pending)
        buf = self._work[: n + 2 * k]
        delta = buf[:n].copy_(self.anchor)
        offset = 0
        for p in self.params:  # delta = anchor - params, one parameter at a time
            delta[offset : offset + p.numel()].sub_(p.detach().reshape(-1).to("cpu", torch.float32))
            offset += p.numel()
        delta.mul_(share)
        buf[n:].copy_(torch.stack(self._pending).reshape(-1))
        if self.feedback is not None:
            sent = self._gather_quantized(buf, n)
        else:
            wire = buf if self.wire == torch.float32 and replicas.comm_device().type == "cpu" else None
            if wire is None:
                wire = buf.to(self.wire).to(replicas.comm_device())
            dist.all_reduce(wire, op=dist.ReduceOp.SUM)
            if wire is not buf:
                buf.copy_(wire)
            sent = wire.numel() * wire.element_size()
        stats = buf[n:].view(k, 2).clone()
        applied = bool(torch.isfinite(delta.sum())) or bool(torch.isfinite(delta).all())  # the sum: no big temporary
        if applied:  # SGD with Nesterov momentum on the pseudo-gradient, as torch.optim.SGD computes it
            mu = self.config.outer_momentum
            self.momentum.mul_(mu).add_(delta)
            self.anchor.sub_(delta.add_(self.momentum, alpha=mu), alpha=self.config.outer_lr)
        replicas.unflatten_into(self.anchor, self.params)
        self._pending, self._weights = [], []
        self._committed = small_state(task, self.loss_scale)
        done = [StepResult(applied and float(s[-1]) == 0.0, s[:-1]) for s in stats]
        return done, sent

    def _gather_quantized(self, buf: torch.Tensor, n: int) -> int:
        """int8/int4: quantized sums do not add up across ranks (each block has its own scale), so every rank
        gathers every rank's codes and scales (plus its fp32 statistics) and adds them up itself, in rank
        order: the same sum, bit for bit, on every rank. Writes the sum into `buf`; returns the bytes sent."""
        assert self.feedback is not None
        codes = self.feedback.encode(buf[:n])
        mine = torch.cat([codes, buf[n:].contiguous().view(torch.uint8)]).to(replicas.comm_device())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        buf.zero_()
        size = codes.numel()
        for theirs in everyone:
            theirs = theirs.to("cpu")
            buf[:n].add_(dequantize(theirs[:size], n, self.feedback.bits))
            buf[n:].add_(theirs[size:].view(torch.float32))
        return mine.numel()

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        done, sent = self._exchange(task) if self._pending else ([], 0)
        self._sync_loss_scale()
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        if rebroadcast:
            self.anchor = self._flat_params()
        return RoundSync(drift=d, rebroadcast=rebroadcast, comm_s=time.perf_counter() - t0, done=done, sent_bytes=sent)

    def _sync_loss_scale(self) -> None:
        """Each rank updated its scale on its own verdicts: all take the smallest (fp16 only)."""
        if not self.loss_scale.enabled:
            return
        scale = torch.tensor([self.loss_scale.scale], dtype=torch.float64, device=replicas.comm_device())
        dist.all_reduce(scale, op=dist.ReduceOp.MIN)
        if float(scale) != self.loss_scale.scale:
            self.loss_scale.load_state_dict({"scale": float(scale), "good_steps": 0})

    def state_bytes(self, task: Task) -> dict[str, int]:
        own = tensor_bytes([self.anchor, self.momentum, self._work])
        own += tensor_bytes([self.feedback.residual]) if self.feedback is not None else 0
        return {"optimizer": tensor_bytes(task.optimizer.state), "strategy": own}

    def measure_comm(self, task: Task, repeats: int) -> float:
        if self.feedback is not None:
            mine = torch.zeros(self.exchange_bytes(task), dtype=torch.uint8, device=replicas.comm_device())
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            return median_seconds(lambda: dist.all_gather(everyone, mine), repeats, collective=True)
        buf = torch.zeros(self.anchor.numel() + 2 * self.config.local_steps, dtype=self.wire)
        buf = buf.to(replicas.comm_device())
        return median_seconds(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM), repeats, collective=True)

    def exchange_bytes(self, task: Task) -> int:
        stats = 2 * self.config.local_steps  # a loss term and a non-finite flag per step
        if self.feedback is not None:  # codes and scales, then the statistics in fp32
            return quantized_nbytes(self.anchor.numel(), self.feedback.bits) + 4 * stats
        return (self.anchor.numel() + stats) * self.wire.itemsize

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "momentum" in state:
            self.momentum = state["momentum"].to("cpu", torch.float32).clone()
