"""The Ray actor of the `Task` path: one device, one replica, the step loop (the process itself: worker_process.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from mixtrain import compat, devices
from mixtrain.comm import process_group, state_transfer
from mixtrain.comm.state_transfer import pack, unpack
from mixtrain.comm.strategy import SyncStrategy
from mixtrain.data.sampling import Arrays
from mixtrain.data.sources import Loader, to_device
from mixtrain.devices import host_allocator, precision
from mixtrain.devices.cpu import CpuShare
from mixtrain.observe import worker_log
from mixtrain.observe.round_profile import RoundProfiler
from mixtrain.records.messages import (
    BuildReport,
    DataReport,
    JoinRequest,
    NumericsResult,
    ProbeResult,
    RoundPlan,
    WorkerReport,
    WorkerSetup,
)
from mixtrain.task import Task, build_task
from mixtrain.worker import build_report, evaluation, probe, strategies, training_state, warm_workers
from mixtrain.worker.join_context import join_context
from mixtrain.worker.ledger import RoundLedger, learning_rates, state_bytes
from mixtrain.worker.probe import DeviceProbe
from mixtrain.worker.worker_data import PER_STEP, Pace, Segment, StepSegments, WorkerData
from mixtrain.worker.worker_process import WorkerProcess


def forward_backward(
    task: Task,
    strategy: SyncStrategy,
    device: torch.device,
    prec: str,
    batches: Iterator[Any],
    chunks: list[np.ndarray],
    step_total: int,
    pace: Pace = PER_STEP,
    filler: Any = None,
) -> torch.Tensor:
    """Backward of this rank's micro-batches (`chunks`, read from `batches`), each mean loss scaled by its
    size / B so the sum over micro-batches and ranks is the global mean (`pace`: by its size / an inner batch
    instead, at local SGD's per-device pace). Returns this rank's term of the
    global mean loss as a 1-element fp32 tensor on the device: reading it here would make every step wait for
    a GPU to finish. A function, not an actor method: Ray wraps every method of an actor class (tracing),
    which cost a few percent of a small model's step. An empty chunk (sliced state, where every rank runs as
    many passes) is a zero-weighted pass over `filler`."""
    total: torch.Tensor | None = None
    for n, chunk in enumerate(chunks):
        if not len(chunk):
            idle_pass(task, device, prec, filler)
            continue
        batch = to_device(next(batches), device)
        with precision.autocast(device, prec), host_allocator.activations():
            loss = task.batch_loss(task.model, batch).float()
        weight = len(chunk) / step_total
        if n == len(chunks) - 1:
            strategy.before_last_backward(task)
        factor = pace.grad_weight(len(chunk), step_total) * strategy.loss_scale.scale
        (loss * factor if factor != 1.0 else loss).backward()  # x * 1.0 is x: a kernel and a graph node fewer
        term = loss.detach() * weight
        total = term if total is None else total + term
    if total is None:  # no samples for this rank in this step
        return torch.zeros(1, device=device)
    return total.reshape(1)


def idle_pass(task: Task, device: torch.device, prec: str, filler: Any, backward: bool = True) -> None:
    """A pass that changes nothing but calls every collective a real one calls (sliced state): `filler` (one
    training sample) forward in eval mode (no statistics or random streams move), and backward of zero times
    its loss (zero gradients go to the owners)."""
    model = task.model
    was_training = model.training
    model.eval()
    try:
        with torch.set_grad_enabled(backward), precision.autocast(device, prec):
            loss = task.batch_loss(model, filler).float()
        if backward:
            (loss * 0.0).backward()
    finally:
        model.train(was_training)


class TrainWorker(WorkerProcess):
    """One replica of a `Task`'s model on one device, and the step loop. Every method is called by the driver for
    all ranks at once (SPMD); between calls the worker holds its state. The process itself (logs, rank, the
    collective group's rendezvous, being kept for the next fit) is WorkerProcess's."""

    def _setup(self, setup: WorkerSetup) -> None:
        super()._setup(setup)
        self.precision_request = setup.precision_request
        self.precision = "fp32"
        self.memory_cap = setup.memory_cap
        self._filler: Any = None  # one training sample on the device, for a sliced run's idle passes
        # Set by the driver's calls, in this order: build, load_data, open_rendezvous (rank 0), join.
        self._task: Task | None = None
        self.data = WorkerData.empty()
        self._strategy: SyncStrategy | None = None
        self._loaded: dict | None = None  # a checkpoint's loss scale and strategy state, until join() applies them
        self._profiler = RoundProfiler(setup.rank)  # off unless MIXTRAIN_PROFILE_DIR is set
        self._eval_batch: int | None = None  # the held-out batch that fit after an out-of-memory error

    @property
    def task(self) -> Task:
        assert self._task is not None, "build() comes first"
        return self._task

    @property
    def strategy(self) -> SyncStrategy:
        assert self._strategy is not None, "join() comes first"
        return self._strategy

    # ---- set-up, in the order the driver calls it -------------------------------------------
    def build(self, factory: Callable[[], Task]) -> BuildReport:
        """Resolve the device where this actor landed, build the replica on it, and report what the
        preflight compares across workers. A missing device is reported, not raised, so the driver
        can show every worker's problem in one table."""
        who = BuildReport(rank=self.rank, host=self.host, requested=self.device_request, versions=compat.versions())
        try:
            self.kind = devices.resolve(self.device_request)
        except devices.DeviceUnavailableError as exc:
            return replace(who, problem=str(exc))
        self.device = self.kind.torch_device(0)
        info = self.kind.info(0)
        if self.kind.cap_memory(self.memory_cap) and self.memory_cap is not None:
            worker_log.log.info(
                "memory: tensors held to %d bytes on %s (DeviceGroup.memory)", self.memory_cap, self.device
            )
        self.precision = precision.choose(self.precision_request, self.kind.kind, info.bf16, info.fp16)
        torch.manual_seed(self.seed)
        self._task = build_task(factory)
        self._module_stats = warm_workers.user_module_stats(self._modules_at_start)
        problem = build_report.float64_problem(self.task.model, self.kind)
        if problem:
            return replace(who, problem=problem)
        self.task.model.to(self.device)
        host_allocator.weights_are(self.task.model)
        return build_report.built(who, self.task, info, self.precision)

    def check_numerics(self, tolerance: float | None = None, count: int = 8) -> NumericsResult:
        """The gradient of the first `count` training samples on this device (at its precision)
        against the same gradient computed on the CPU in fp32: the relative L2 difference."""
        tolerance = tolerance or probe.NUMERICS_TOLERANCE[self.precision]
        if self.kind.kind == "cpu" and self.precision == "fp32":
            return NumericsResult(rank=self.rank, error=0.0, tolerance=tolerance)  # the reference itself
        count = min(count, len(self.data.train))
        batch = self.data.train.first(count).batch(count)  # the probe's samples too: read once for both
        error = self._device_probe().numerics_error(batch)
        return NumericsResult(rank=self.rank, error=error, tolerance=tolerance)

    def probe(self, guess: int, limit: int, memory_cap: int | None = None, forward_only: bool = False) -> ProbeResult:
        """Before the group forms: this device's speed (samples/s of reading and forward+backward at a micro-batch
        of `guess`) and, on an accelerator, the largest micro-batch up to `limit` that fits, found by a search that
        survives out-of-memory errors. A user-given `memory_cap` skips the search. Every trial runs on the first
        `guess` training samples, each read once (those the start-up checks read among them) and repeated for a
        larger trial: their reading time, measured that once, is added per sample to the timed compute, so slow
        loading still counts without reading the user's data over and over. Weights, buffers (BatchNorm
        statistics), gradients and random streams are left as they were. `forward_only` (sliced state: the whole
        gradient may not fit here): no memory search, and forward passes without gradients, timed x3 (a backward
        costs about two forwards); the rounds' measured times correct the shares from there."""
        return self._device_probe().measure(
            self.rank, self.data.train, guess, limit, memory_cap, forward_only, self._free_cached_memory
        )

    def _device_probe(self) -> DeviceProbe:
        return DeviceProbe(self.task, self.kind, self.device, self.precision)

    def _free_cached_memory(self) -> None:
        self.task.model.zero_grad(set_to_none=True)
        self.kind.empty_cache()

    def measure_comm(self, repeats: int = 5) -> tuple[float, int]:
        """Seconds of one exchange with no compute in the way (median of `repeats`), and its bytes."""
        return self.strategy.measure_comm(self.task, repeats), self.strategy.exchange_bytes(self.task)

    def leave(self) -> None:
        """Leave the process group (before the driver re-forms it without some workers)."""
        if self._strategy is not None:
            self._strategy.close()
        super().leave()

    def join(self, request: JoinRequest) -> None:
        """Join the collective group at rank 0's rendezvous and set the strategy up on it, keeping what the
        strategy held (a re-formed group) unless a state was just loaded."""
        self._join_group(request)
        previous, self._strategy = self._strategy, strategies.make(request.strategy, request.shard_level)
        loaded, self._loaded = self._loaded, None
        training_state.before_setup(self.task, self.strategy, loaded, previous)
        ctx = join_context(request, self.rank, self.world_size, self.kind, self.device)
        sliced = request.shard_level in ("gradients", "full")
        host_allocator.sliced_state(sliced)  # before setup: its buffers come and go as the steps' will
        self.strategy.setup(self.task, ctx)
        if sliced:  # the weights others own, built whole in the heap and freed by setup: back to the system
            host_allocator.trim()
        training_state.after_setup(self.task, self.strategy, loaded, previous)

    def load_data(self, train: Arrays | Loader, evaluation: Arrays | Loader | None) -> DataReport:
        """Open the training and held-out data here: in-memory fields from the object store, or a Dataset
        (built here when given as a function) read lazily through a DataLoader."""
        self.data.close()
        self.data = WorkerData.open(train, evaluation, self.seed, self.kind)
        report = self.data.report(self.rank)
        if self._task is not None:  # one sample as the task will see it: a mismatch said now, not deep in the model
            problem = self._task.batch_problem(self.data.train.first(1).batch(1))  # the probe's first sample
            report = replace(report, problem=problem or "")
        return report

    # ---- training ---------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> WorkerReport:
        """Run the round's steps. If a collective fails because a peer died or stopped answering, the report
        says so (peer_lost) with how many of the round's steps this replica committed; the driver then calls
        `recover` and hands the most advanced survivor's state to those behind. No copy of the training state
        is kept for this: committed steps are the same on every replica that saw them."""
        ledger = RoundLedger(self.rank)
        self.strategy.begin_round(self.task)
        try:
            with self._profiler.round(self.device):
                report = self._run_round(plan, ledger)
        except Exception as exc:
            oom = self.kind.is_oom(exc)
            if not (oom or process_group.is_peer_failure(exc)):
                raise
            try:  # steps applied whose verdicts were still to be read count as committed (StepGate)
                ledger.take_late(self.strategy.flush(self.task))
            except Exception as late:
                worker_log.log.warning("could not read the last step's verdict: %s", late)
            committed = ledger.committed_steps if self.strategy.keeps_partial_rounds else 0
            if oom:  # out of memory here: leave the group at once, so the peers' collectives fail now, not
                self._free_cached_memory()  # after the collective timeout; the driver lowers the micro-batch
                process_group.leave_group()
            report = ledger.abort(str(exc).splitlines()[0][:300], committed)
            report.out_of_memory = oom
            report.peer_silent = not oom and process_group.is_peer_silence(exc)
            return report
        if not self.strategy.keeps_partial_rounds:  # should a peer fail before the driver hears, all is redone
            report.committed_steps = 0
        return report

    def _run_round(self, plan: RoundPlan, ledger: RoundLedger) -> WorkerReport:
        index = self.device.index or 0
        self.kind.reset_peak_memory(index)
        pace = Pace(self.strategy.inner_batch(plan.global_batch, len(plan.shares)))
        steps = self._round_segments(plan, pace)
        chunks = [c for _, _, segments in steps for seg, _ in segments for c in seg if len(c)]
        batches = self.data.train.batches(plan.epoch, chunks)
        self.task.model.train()
        if not pace.per_step:  # per-device pace: gradients add up across steps until an inner batch is full
            self.strategy.zero_grad(self.task)
        cpu = CpuShare(enabled=self.kind.kind == "cpu")  # the share of a core forward and backward got
        for step, step_total, segments in steps:
            num_samples = sum(len(c) for seg, _ in segments for c in seg)
            t0 = time.perf_counter()
            if pace.per_step:
                self.strategy.zero_grad(self.task)
            local_loss = self._compute(segments, batches, step_total, pace, cpu)
            stats = local_loss if self.strategy.stats_on_device else local_loss.cpu()
            outcome = self.strategy.step(self.task, stats, num_samples / step_total)
            ledger.step_done(step, outcome, time.perf_counter() - t0, num_samples, local_loss)
        measured = cpu.close()
        if measured is not None:
            ledger.report.cpu_share, ledger.report.cpu_wait_s = measured
        weight = plan.shares[self.rank] / sum(plan.shares)  # for buffer averaging: this rank's part of the round
        sync = self.strategy.end_round(self.task, weight, plan.drift_tolerance)
        lr = learning_rates(self.task.optimizer)  # after end_round: a step read late has had its scheduler step
        return ledger.close(plan, sync, self.kind.memory_in_use(index), state_bytes(self.task, self.strategy), lr)

    def _compute(
        self, segments: list[Segment], batches: Iterator[Any], step_total: int, pace: Pace, cpu: CpuShare
    ) -> torch.Tensor:
        """One step's forward and backward passes on this worker's micro-batches (and, at per-device pace, the
        inner steps where its inner batch fills): this rank's term of the step's mean loss, on the device."""
        local_loss: torch.Tensor | None = None
        for seg, fraction in segments:
            cpu.start()
            term = forward_backward(
                self.task, self.strategy, self.device, self.precision, batches, seg, step_total, pace, self._filler
            )
            cpu.stop()
            local_loss = term if local_loss is None else local_loss + term
            if fraction:
                self.strategy.inner_step(self.task, fraction)
        if self.world_size > 1:  # the planner splits shares by compute time: queued kernels are compute, not the
            self.kind.synchronize(self.device.index or 0)  # exchange's (free: the exchange waits for them anyway)
        if local_loss is None:  # (per-device pace: no samples here in this step)
            return torch.zeros(1, device=self.device)
        return local_loss

    def _round_segments(self, plan: RoundPlan, pace: Pace) -> list[StepSegments]:
        """The round's steps, each as segments of micro-batches, as `pace` cuts them."""
        steps = self.data.round_chunks(plan, self.rank, lockstep=self.strategy.lockstep)
        if self.strategy.lockstep:
            self._idle_sample()  # read now, outside the timed passes
        if pace.per_step:
            return pace.segments(steps, [])
        flush = self.strategy.exchanges_after(len(steps))
        flush[-1] = True  # a round ends with an exchange
        return pace.segments(steps, flush)

    def _idle_sample(self) -> Any:
        """One training sample on the device (the data's first), read once, for idle passes."""
        if self._filler is None:
            sample = self.data.train.first(1).batch(1)
            self.data.train.forget_first()
            self._filler = to_device(sample, self.device)
        return self._filler

    # ---- evaluation and results -------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, start: int, stop: int, batch: int) -> dict[str, float]:
        """Sums over held-out samples [start, stop): loss times count, and the metrics' (sum, count), in batches of
        at most `batch`. Out of memory, the batch is halved and the rest read again (the size that worked is kept
        for the next evaluation); when even one sample does not fit, the sums so far come back with
        `unevaluated_from`, the first sample left, and the driver hands the rest to the other workers."""
        assert self.data.eval is not None, "evaluate called without eval data"
        self.task.model.eval()
        held_out = evaluation.HeldOut(self.task, self.data.eval, self.device, self.precision)
        if self._strategy is not None and self.strategy.lockstep:
            return held_out.lockstep(
                start,
                stop,
                batch,
                lambda: idle_pass(self.task, self.device, self.precision, self._idle_sample(), backward=False),
            )
        batch = max(1, min(batch, self._eval_batch or batch))
        sums, halved = held_out.halving(start, stop, batch, self.kind.is_oom, self._free_cached_memory)
        self._eval_batch = halved or self._eval_batch
        return sums

    # ---- checkpoints, resume and recovery ---------------------------------------------------
    def training_state(self) -> dict:
        """Everything a step changes, packed for the object store (state_transfer): weights, optimizer (this
        rank's part where the strategy keeps it elsewhere: the driver merges the rest), scheduler, the job-wide
        loss scale and the strategy's own state. For checkpoints, replacements and survivors that fell behind."""
        return training_state.packed(self.task, self.strategy)

    # Streamed copies (state_transfer.stream) for the driver: in pieces small enough to travel in the replies, so
    # no second copy builds up in this process (GroupCalls.receive reads them).
    def stream_training_state(self) -> Iterator[Any]:
        yield from state_transfer.stream(unpack(self.training_state()))

    def stream_optimizer_part(self) -> Iterator[Any]:
        yield from state_transfer.stream(unpack(self.optimizer_part()))

    def stream_state_dict(self) -> Iterator[Any]:
        yield from state_transfer.stream(unpack(self.state_dict()))

    def stream_rank_state(self) -> Iterator[Any]:
        """What this replica holds that the others do not (SyncStrategy.rank_state: local SGD's inner optimizer),
        streamed like the training state: returned whole, it went through the object store, whose pages stayed in
        this worker's resident memory after every checkpoint (197 MB at the peak, 12.6M-parameter AdamW model)."""
        yield from state_transfer.stream(self.strategy.rank_state(self.task))

    def optimizer_part(self) -> dict:
        """This rank's slice of a sharded optimizer's state (by the optimizer's parameter numbers) and of sliced
        weights (by state_dict key), packed."""
        t = self.task
        return pack({"optimizer": self.strategy.optimizer_state(t)["state"], "model": self.strategy.model_part(t)})

    def load_training_state(self, state: dict, rng: dict | None = None, rank_state: dict | None = None) -> None:
        """Continue from `state` (a checkpoint's, or another replica's): weights and scheduler now; optimizer,
        loss scale and the strategy's own state when the group forms next (join), which always follows, so a
        sharded optimizer keeps only its slice. `rank_state`: what this rank held of its own when the checkpoint
        was written (local SGD's inner optimizer and error feedback), for a resume on as many workers."""
        self._loaded = training_state.load(self.task, self._strategy, self.kind, state, rng, rank_state)

    def recover(self) -> None:
        """After a failed round: back to this replica's last committed state, and out of the broken group."""
        self.strategy.recover(self.task)
        self.leave()

    def state_dict(self) -> dict:
        """The model's weights and buffers, packed (the driver unpacks them; sliced weights: from every rank,
        GroupOps.full_state)."""
        return pack(self.task.model.state_dict())

    def _release(self) -> None:
        """The task, its data and what the strategy and a loaded state held."""
        self.data.close()
        self.data = WorkerData.empty()
        self._task = self._strategy = self._loaded = None
