"""Local SGD with DiLoCo's outer optimizer: H local steps per worker, then one average of deltas.

Each worker steps its own copy of the user's optimizer (the inner optimizer) on the mean
gradient of its own samples. Every `local_steps` steps the workers all-reduce their parameter
deltas from the last common point, weighted by their share of the samples, and every rank
applies the average as a gradient to that common point with SGD + Nesterov momentum (by default lr 1
and no momentum: plain averaging; DiLoCo's lr 0.7, momentum 0.9 suit H in the hundreds). One collective
per H steps instead of one per step. A round always ends with an exchange, so replicas are equal at every
round boundary (checkpoints, workers leaving and joining work as with all-reduce); the controller sizes
rounds in whole multiples of H (RunSettings.steps_per_exchange), so that exchange is never an early one, but
at an epoch's end.
Inner optimizer states stay per worker; a checkpoint keeps one worker's (the driver's nearest: GroupOps._full_state).

With `compress` int8 or int4 the deltas travel quantized (a scale per 256 values) with error feedback
(compress.ErrorFeedback), through an all-gather: every rank sums every rank's dequantized delta in rank
order, so the replicas stay equal bit for bit.

With `overlap` the exchange runs in the background (a non-blocking collective on the same group) while the
next H inner steps compute, and its average is applied one exchange late (the delayed outer update of
Streaming DiLoCo). The replicas share a common point A that lags one exchange; each worker's weights are
A minus its own progress since its last exchange. At an exchange the worker measures that progress d,
waits for the exchange in flight (the average D of the previous window), moves A by the outer step on D,
sets its weights to the new A - d and sends d in the background. So every worker's own last H steps stay
applied while the average of everyone's previous H steps arrives; the outer optimizer sees the same
pseudo-gradients as without overlap, one exchange later. A round's end waits for the exchange in flight and
exchanges what is left at once (blocking): replicas are equal at every round boundary and checkpoint, as
without overlap. Rounds hold at least OVERLAP_EXCHANGES_PER_ROUND exchanges so that that one blocking
exchange is a small part of a round.

A step is committed at the exchange that averages it (with overlap: when that average is applied). When a
peer is lost mid-round, a worker goes back to its common point (the weights, scheduler position and loss
scale of its last applied exchange) and the steps since are redone; its inner optimizer state keeps what those steps
added (local SGD makes no exactness promise; the common point is exact).

Here: the inner steps, the windows, overlap and recovery. How an exchange travels and is summed:
comm/delta_wire.py; the outer step on the sum, and plain averaging in pieces: comm/outer_step.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixtrain import devices
from mixtrain.comm import replicas
from mixtrain.comm.buckets import grads_finite
from mixtrain.comm.delta_wire import DeltaWire
from mixtrain.comm.outer_step import average_in_pieces, outer_step, step_results, subtract_weights
from mixtrain.comm.strategy import (
    JoinContext,
    RoundSync,
    StepOutcome,
    StepResult,
    SyncStrategy,
    clip_gradients,
    load_small_state,
    small_state,
    tensor_bytes,
)
from mixtrain.devices.precision import LossScale
from mixtrain.task import Task


@dataclass
class _InFlight:
    """An exchange running in the background (overlap): its collective, its buffer, and what it commits."""

    work: Any
    """The non-blocking collective's handle (`dist.Work`)."""
    buf: torch.Tensor
    """The fp32 buffer the sum lands in: n delta values, then 2 statistics per step."""
    wire: torch.Tensor | list[torch.Tensor]
    """What travels: `buf` itself, its narrower copy, or (int8/int4) every rank's gathered codes."""
    steps: int
    committed: dict[str, Any]
    """The scheduler position and loss scale after the window's last step: the restore point once applied."""


class LocalSGDStrategy(SyncStrategy):
    name = "local-sgd"
    momentum: torch.Tensor = torch.zeros(0)
    """The outer optimizer's momentum buffer (the same on every rank); kept across re-formed groups."""

    def setup(self, task: Task, ctx: JoinContext) -> None:
        replicas.broadcast_state(task.model)
        self.params = [p for p in task.model.parameters() if p.requires_grad]
        self.anchor = self._flat_params()  # the last common point, on the CPU in fp32
        # first set-up (a re-formed group keeps it); none at all without outer momentum (the default): one
        # copy of the weights less on every worker
        if self.config.local_sgd.outer_momentum and self.momentum.numel() != self.anchor.numel():
            self.momentum = torch.zeros_like(self.anchor)
        self.overlap = self.config.local_sgd.overlap and dist.get_world_size() > 1
        self.wire = DeltaWire(self.config.compress)
        quantized = self.wire.feedback is not None
        self.chunked = not (self.overlap or quantized or self.config.local_sgd.outer_momentum) and all(
            p.dtype == torch.float32 and p.is_contiguous() for p in self.params
        )
        """Plain averaging exchanges in pieces of one gradient bucket (MIXTRAIN_BUCKET_MB) through one buffer
        of that size, writing the new common point into the weights as it goes (_exchange_chunked): a buffer
        as large as the model less (outer_step.average_in_pieces). Overlap, outer momentum and int8/int4 need the
        whole delta at once."""
        self.piece = max(1, ctx.bucket_bytes // 4)  # fp32 values per piece
        n, stats = self.anchor.numel(), 2 * self.config.local_sgd.local_steps
        size = (min(n, self.piece) if self.chunked else n) + stats
        self._work = torch.zeros(size)  # the exchange's buffer (overlap: two, one in flight)
        self._spare = torch.zeros(size) if self.overlap else torch.zeros(0)
        self.base = self.anchor.clone() if self.overlap else self.anchor
        """Where this worker's own progress is measured from (overlap: A minus its progress in flight)."""
        self._inflight: _InFlight | None = None
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)
        self._pending: list[torch.Tensor] = []  # per step since the last exchange: [loss term, non-finite]
        self._weights: list[float] = []
        self._committed: dict[str, Any] = {}  # scheduler and loss scale at the last exchange
        self._inner_finite: bool = True  # per-device pace: the inner steps since the last step(), all finite
        self._inner_norm: torch.Tensor | None = None  # and the last one's gradient norm

    def begin_round(self, task: Task) -> None:
        self._committed = small_state(task, self.loss_scale)  # a round starts at a common point

    def recover(self, task: Task) -> None:
        self._inflight = None  # its group is gone; its steps are redone from the common point
        self._to_common_point()
        if self.wire.feedback is not None:  # the residual of a delta no survivor applied
            self.wire.feedback.reset()
        load_small_state(task, self.loss_scale, self._committed)
        self._pending, self._weights = [], []
        self._inner_finite, self._inner_norm = True, None

    def _to_common_point(self) -> None:
        """The weights (and, with overlap, the base progress is measured from) become the common point."""
        replicas.unflatten_into(self.anchor, self.params)
        if self.overlap:  # (without overlap the base is the common point itself)
            self.base.copy_(self.anchor)

    def _flat_params(self) -> torch.Tensor:
        return replicas.flat_on_host(self.params, torch.float32)

    def zero_grad(self, task: Task) -> None:
        task.model.zero_grad(set_to_none=True)

    def inner_batch(self, global_batch: int, world_size: int) -> int | None:
        return -(-global_batch // world_size) if self.config.local_sgd.pace == "per-device" else None

    def exchanges_after(self, num_steps: int) -> list[bool]:
        h = self.config.local_sgd.local_steps
        left = h - len(self._pending)
        return [(i + 1 - left) % h == 0 for i in range(num_steps)]

    def _optimizer_step(
        self, task: Task, fraction: float, also: tuple[torch.Tensor, ...] = ()
    ) -> tuple[bool, torch.Tensor | None]:
        """Step the inner optimizer on the mean gradient of this rank's samples since the last step, whose
        gradients add up to `fraction` times it (times the loss scale); skipped when it (or `also`) is not finite."""
        grads = [p.grad for p in self.params if p.grad is not None]
        finite = grads_finite(grads, *also)  # one norm; elementwise only when it is not finite
        norm = None
        if finite:
            factor = 1.0 / (fraction * self.loss_scale.scale)
            for g in grads:
                g.mul_(factor)
            norm = clip_gradients(task, self.params)  # this worker's own mean gradient (local SGD)
            task.optimizer.step()
        self.loss_scale.update(finite)
        return finite, norm

    def inner_step(self, task: Task, fraction: float) -> None:
        finite, self._inner_norm = self._optimizer_step(task, fraction)
        self._inner_finite &= finite
        self.zero_grad(task)

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        norm = None
        if self.config.local_sgd.pace == "per-device":  # the inner steps ran as their batches filled (inner_step); the
            finite = devices.all_finite([local_stats]) and self._inner_finite  # schedule follows the global steps
            norm, self._inner_norm, self._inner_finite = self._inner_norm, None, True
            if task.scheduler is not None:
                task.scheduler.step()
        elif weight > 0:
            finite, norm = self._optimizer_step(task, weight, also=(local_stats,))  # this rank's own mean gradient
            if finite and task.scheduler is not None:
                task.scheduler.step()
        else:  # no samples here in this step
            finite = devices.all_finite([local_stats])
        self._pending.append(torch.cat([local_stats.float().reshape(-1), torch.tensor([0.0 if finite else 1.0])]))
        self._weights.append(weight)
        if len(self._pending) < self.config.local_sgd.local_steps:
            return StepOutcome(done=[], comm_s=0.0, grad_norm=norm)
        t0 = time.perf_counter()
        done, sent = self._exchange_overlapped(task) if self.overlap else self._exchange(task)
        return StepOutcome(done=done, comm_s=time.perf_counter() - t0, sent_bytes=sent, grad_norm=norm)

    def _pack(self, buf: torch.Tensor) -> float:
        """Write this worker's progress since its base (base - params) and the pending per-step statistics
        into `buf`; return this rank's part of the samples since the last exchange (the delta's weight)."""
        n = self.base.numel()
        subtract_weights(self.params, buf[:n].copy_(self.base), 0, n)
        buf[n:].copy_(torch.stack(self._pending).reshape(-1))
        return self._share()

    def _share(self) -> float:
        """This rank's part of the samples since the last exchange (the weight of its delta)."""
        return sum(self._weights) / len(self._weights)

    def _exchange(self, task: Task) -> tuple[list[StepResult], int]:
        """Average the weighted deltas and the pending per-step statistics in one collective, then
        apply the outer step to the common point. Everything happens in one reused fp32 buffer: no
        temporary as large as the model besides a narrower wire copy when compressing."""
        if self.chunked:
            pending, outer_lr = torch.stack(self._pending), self.config.local_sgd.outer_lr
            done, sent = average_in_pieces(
                self.params, self.anchor, self._work, pending, self._share(), self.piece, self.wire, outer_lr
            )
        else:
            n, k = self.anchor.numel(), len(self._pending)
            buf = self._work[: n + 2 * k]
            buf[:n].mul_(self._pack(buf))
            work, wire, sent = self.wire.launch(buf, n, async_op=False)
            done = self._land(buf, n, k, wire, work)
            self._to_common_point()
        self._pending, self._weights = [], []
        self._committed = small_state(task, self.loss_scale)
        return done, sent

    def _exchange_overlapped(self, task: Task) -> tuple[list[StepResult], int]:
        """Send this window's delta in the background; apply the previous window's average (waiting for it
        if it has not arrived) and keep this window's own progress on top of it. Returns the previous
        window's step results (none at a round's first exchange)."""
        n, k = self.anchor.numel(), len(self._pending)
        buf = self._work[: n + 2 * k]
        share = self._pack(buf)  # d: this worker's progress in this window, unweighted
        landed = self._inflight is not None
        done = self._finish() if landed else []
        self.base.copy_(self.anchor).sub_(buf[:n])  # A - d: the average so far plus this worker's own window
        if landed:  # (else A is where this window started: the weights are A - d already)
            replicas.unflatten_into(self.base, self.params)
        buf[:n].mul_(share)
        work, wire, sent = self.wire.launch(buf, n, async_op=True)
        committed = small_state(task, self.loss_scale)
        self._inflight = _InFlight(work, buf, wire, k, committed)
        self._work, self._spare = self._spare, self._work  # the next window packs into the other buffer
        self._pending, self._weights = [], []
        return done, sent

    def _finish(self) -> list[StepResult]:
        """Wait for the exchange in flight and apply its average to the common point."""
        flight, self._inflight = self._inflight, None
        assert flight is not None
        done = self._land(flight.buf, self.anchor.numel(), flight.steps, flight.wire, flight.work)
        self._committed = flight.committed
        return done

    def _land(self, buf: torch.Tensor, n: int, k: int, wire: Any, work: Any) -> list[StepResult]:
        """Wait for the collective, put the sum into `buf` and apply the outer step to the common point."""
        self.wire.receive(buf, n, wire, work)
        stats = buf[n:].view(k, 2).clone()
        config = self.config.local_sgd
        applied = outer_step(self.anchor, buf[:n], self.momentum, config.outer_lr, config.outer_momentum)
        return step_results(stats, applied)

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        landed = self._inflight is not None
        done = self._finish() if landed else []
        sent = 0
        if self._pending:  # what is left is exchanged at once: replicas are equal at a round boundary
            more, sent = self._exchange(task)
            done += more
        elif landed:  # overlap: the last window was in flight; the weights become the common point
            self._to_common_point()
        self._sync_loss_scale()
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        if rebroadcast:
            self.anchor.copy_(self._flat_params())
            if self.overlap:
                self.base.copy_(self.anchor)
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
        own = tensor_bytes([self.anchor, self.momentum, self._work, self._spare])
        own += tensor_bytes([self.base]) if self.overlap else 0
        own += tensor_bytes([self.wire.feedback.residual]) if self.wire.feedback is not None else 0
        return {"optimizer": tensor_bytes(task.optimizer.state), "strategy": own}

    def measure_comm(self, task: Task, repeats: int) -> float:
        pieces = -(-self.anchor.numel() // self.piece) if self.chunked else 1  # the same collectives as an exchange
        return self.wire.measure(self.exchange_bytes(task), self._work.numel(), pieces, repeats)

    def exchange_bytes(self, task: Task) -> int:
        return self.wire.nbytes(self.anchor.numel(), 2 * self.config.local_sgd.local_steps)  # 2: loss, non-finite

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum.clone()}

    def rank_state(self, task: Task) -> dict[str, Any]:
        """Each replica steps its inner optimizer on its own samples, so its state (momentum, Adam's moments)
        is its own, and so is what quantization dropped from its last delta (the error feedback)."""
        out: dict[str, Any] = {"optimizer": self.optimizer_state(task)}
        if self.wire.feedback is not None:
            out["residual"] = self.wire.feedback.residual.clone()
        return out

    def load_rank_state(self, task: Task, state: dict[str, Any]) -> None:
        residual = state.get("residual")
        if self.wire.feedback is not None and isinstance(residual, torch.Tensor):
            self.wire.feedback.residual = residual.to("cpu", torch.float32).clone()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "momentum" in state:
            self.momentum = state["momentum"].to("cpu", torch.float32).clone()
