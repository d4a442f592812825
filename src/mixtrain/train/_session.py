"""The worker's side of a loop run: what `get_context()`, `report()`, `get_checkpoint()` and the prepared model and
loaders ask, for the one loop that runs in this worker process. Set by LoopWorker.run_loop for the loop's length."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mixtrain.errors import InputValueError
from mixtrain.policies.decisions import Decision, LeaveOut, Rebalancer
from mixtrain.train.checkpoint import Checkpoint

MEASURE_WINDOW_S = 0.1
"""A plan's speeds come from at least this much of a worker's compute since the last window closed (a window of
fewer seconds goes on growing): steps of a millisecond, measured two at a time, were mostly the scheduler's noise on
a loaded machine, and moved a 3x-slow worker's shares above the fast one's (a CI run)."""
MEASURE_STEPS = 3
"""Steps with samples a window holds before its median speaks (of 2, one stretched step would be half of it)."""


class LoopStopped(BaseException):
    """Raised from `report()` on every worker when the run is to stop there (Ctrl-C): a BaseException, so a loop's
    own `except Exception` lets it through."""


@dataclass(frozen=True)
class TrainContext:
    """Who this worker is in the run (Ray Train's TrainContext, and what mixtrain adds: the device, the share)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: torch.device
    experiment_name: str
    _session: LoopSession | None = field(default=None, repr=False, compare=False)

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str:
        return self.experiment_name

    def get_device(self) -> torch.device:
        return self.device

    def get_share(self) -> int:
        """This worker's samples of each global batch in the epoch under way (its last prepared loader's)."""
        return self._session.share if self._session is not None else 0


@dataclass
class LoopSession:
    """One loop's state on this worker. `report_to(rank, index, metrics, files)` hands a report to the driver and
    answers whether the run is to stop; `plan_to(record)` tells it a new split."""

    context: TrainContext
    seed: int
    shares: Any
    """ScalingConfig.shares: "auto" (follow measured speed), "equal", or fixed relative sizes per rank."""
    bucket_bytes: int
    report_to: Callable[[int, int, dict[str, Any], dict[str, bytes] | None], bool]
    plan_to: Callable[[dict[str, Any]], None]
    checkpoint: Checkpoint | None = None
    batch_workers: int = 0
    """Workers a global batch is counted for (the run's asked-for count): batch_size times this."""
    leave_out_gain: float | None = None
    """With shares="auto": a worker the job is predicted this much faster without is named to the driver, which
    restarts the loop without it at the next report with a checkpoint (None: never)."""
    leave_out_named: bool = False
    """A worker to leave out is named to the driver (which acts at the next report with a checkpoint)."""
    resumes: bool = False
    """The loop called get_checkpoint() in this attempt, so a restart goes on from the checkpoint it reported.
    Only such a loop is restarted without a slow worker: a loop that never asks would start again from its first
    epoch and train twice what it had trained (issue 45)."""
    global_batches: list[int] = field(default_factory=list)
    """The run's global batch of each prepared loader, by the order of the loop's prepare_data_loader calls, as
    the first attempt that prepared it asked: a later attempt keeps it (see loader_global_batch)."""
    event_to: Callable[[str, dict[str, Any]], None] = lambda kind, record: None
    """Hands the driver a record at once (it has arrived when this returns)."""
    rebalance_threshold: float = 0.1
    """Within an epoch, shares move only when the slowest worker's predicted compute exceeds the mean by more than
    this fraction (MIXTRAIN_REBALANCE_THRESHOLD, as between a Task's rounds)."""
    after_compute: list[Callable[[float], None]] = field(default_factory=list)
    """Called with each forward-and-backward's seconds as its backward ends (without a prepared model: with each
    step's compute, at the next batch). EMULATION of a slower device hooks in here (worker/emulation.py) and
    stretches what a slower device takes longer for, as the benchmarks' DDP emulation does."""
    weight: float = 1.0
    """The share of its step's global batch of the batch this worker holds now (each rank's gradient is weighted
    by it). Without a prepared loader: 1 / world size, DDP's average."""
    share: int = 0
    grads: list[Any] = field(default_factory=list)
    """The prepared models' LoopGrads (their time in the exchange is not compute)."""
    models: list[torch.nn.Module] = field(default_factory=list)
    """The prepared models (a GAN's two): the host allocator's threshold follows the largest weight of them all."""
    _reports: int = 0
    _last_batch: tuple[float, float, int] | None = None  # (perf_counter, exchange seconds so far, samples)
    _hooks_s: float = 0.0  # what the after_compute hooks took at the last batch (it falls into the next one)
    _steps: int = 0
    _rebalancers: dict[int, Rebalancer] = field(default_factory=dict)
    in_force: dict[int, list[int]] = field(default_factory=dict)
    """The shares each prepared loader's global batch was last cut by (an epoch starts from its last one's)."""
    _kept_told: bool = False  # the driver was told that a worker is kept, as leaving it out would repeat training
    _loaders: int = 0  # prepare_data_loader calls so far
    _mark: tuple[int, float, float] = (0, 0.0, 0.0)
    """(steps, exchange s, perf_counter) at the last plan point."""
    _window: list[tuple[int, float]] = field(default_factory=list)
    """(samples, compute s) of each step since the measuring window opened."""
    _rate: float = 0.0  # the speed the last plan was told (0: nothing measured yet)

    def __post_init__(self) -> None:
        self.weight = 1.0 / self.context.world_size

    # ---- speed, measured from one batch to the next -----------------------------------------------
    def begin_batch(self, samples: int, step_samples: int) -> None:
        """A prepared loader hands out a batch of `samples` of its step's `step_samples`: the time since the last
        one, less the time spent in the exchange, is the last batch's compute."""
        mark = self.close_interval()
        if mark is None:  # a fresh start (an epoch's first batch, after a plan point): no hook's time falls in it
            mark, self._hooks_s = (time.perf_counter(), self._exchange_s()), 0.0
        self._last_batch = (*mark, samples)
        self.weight = samples / step_samples if step_samples else 0.0

    def close_interval(self) -> tuple[float, float] | None:
        """The batch handed out last is done: count its compute now, and return when (clock, exchange seconds so
        far), before the slowdown hooks run (their time falls into the next batch's). A plan point calls it before
        it gathers the speeds and forgets the mark, so neither the wait there for the slowest worker nor a loader
        restarted after a move counts as a step's compute (they had made a fast worker look as slow as the slow
        one: a move to equal shares)."""
        if self._last_batch is None:
            return None
        now, comm = time.perf_counter(), self._exchange_s()
        t0, comm0, done = self._last_batch
        self._last_batch = None
        compute = max(0.0, now - t0 - (comm - comm0))
        self._steps += 1
        self._window.append((done, compute))  # what the hooks took included: the planner sees it
        if not self.grads:  # no prepared model told its work: the step's compute, less what the hooks took
            t1 = time.perf_counter()
            self.work_done(max(0.0, compute - self._hooks_s))
            self._hooks_s = time.perf_counter() - t1
        return now, comm

    def end_epoch(self) -> None:
        self._last_batch = None  # the time between epochs (evaluation, a checkpoint) is not a step's
        self._hooks_s = 0.0

    def exchange_per_step(self) -> float:
        """Seconds in the exchange per step so far (waiting for slower workers included)."""
        return self._exchange_s() / self._steps if self._steps else 0.0

    def measured(self) -> tuple[float, float, float]:
        """(samples per compute second, exchange seconds per step, wall seconds per step): what a new plan is made
        from. The speed is the median of the measuring window's steps' own, once it holds MEASURE_STEPS of them (a
        step the scheduler, the garbage collector or a first step's warm-up stretched moves it little; until then
        the last window's, 0 before any: nothing measured yet); the window closes, and the next one opens, once it
        holds as many steps and MEASURE_WINDOW_S of compute. The exchange and the wall clock are since the last
        call (the wall clock 0, unknown, where that was under 2 steps)."""
        steps0, exchange0, wall0 = self._mark
        exchange, now = self._exchange_s(), time.perf_counter()
        rates = [samples / compute for samples, compute in self._window if samples and compute > 0]
        if len(rates) >= MEASURE_STEPS:
            self._rate = statistics.median(rates)
        if len(self._window) >= MEASURE_STEPS and sum(compute for _, compute in self._window) >= MEASURE_WINDOW_S:
            self._window = []  # (steps without samples count here, so that a window of them closes too)
        steps = self._steps - steps0
        self._mark = (self._steps, exchange, now)
        if steps >= 2:
            return self._rate, (exchange - exchange0) / steps, (now - wall0) / steps
        return self._rate, self.exchange_per_step(), 0.0

    def _exchange_s(self) -> float:
        return sum(g.comm_s for g in self.grads)

    def work_done(self, seconds: float) -> None:
        """A forward and backward took `seconds` (a prepared model tells it as its backward ends)."""
        for hook in self.after_compute:
            hook(seconds)

    def rebalancer(self, global_batch: int) -> Rebalancer:
        """The policy a Task's rounds follow (policies/decisions.Rebalancer: its hysteresis, its votes over plan
        points in a row, its model-based and measured leave-out checks), one per prepared loader's global batch.
        Every worker asks it the same question from the same gathered figures, so all get the same answer."""
        if global_batch not in self._rebalancers:
            self._rebalancers[global_batch] = Rebalancer(
                global_batch=global_batch,
                leave_out_slow=self.leave_out_gain is not None,
                threshold=self.rebalance_threshold,
                min_gain=self.leave_out_gain if self.leave_out_gain is not None else 0.0,
            )
        return self._rebalancers[global_batch]

    def leave_out_vote(self, decision: Decision, voting: bool) -> dict[str, Any]:
        """What the driver is told of a plan point's decision on leaving a worker out: the worker named once the
        rebalancer votes for it (EXCLUDE_ROUNDS plan points in a row: one noisy measurement must not cost a device),
        still named while the next plan points go on voting (`voting`), withdrawn when one finds nobody; in a loop
        that never called get_checkpoint() kept instead, and the driver told so once. Returns {"leave_out": the
        worker named or None (withdrawn)}, {"leave_out_kept": the worker kept}, or {} (nothing new)."""
        named = {"rank": decision.rank, "reason": decision.reason} if isinstance(decision, LeaveOut) else None
        if named is None and voting:
            return {}  # a vote under way: what was named (or not) stays so
        if named is not None and not self.resumes:
            told, self._kept_told = self._kept_told, True
            return {} if told else {"leave_out_kept": named}
        if (named is not None) == self.leave_out_named:
            return {}
        self.leave_out_named = named is not None
        return {"leave_out": named}

    def loader_global_batch(self, batch_size: int) -> int:
        """The global batch of the loop's next prepared loader. The run's first attempt fixes it: batch_size times
        the workers the run asked for. A later attempt keeps it whatever its loader asks (a loop that divides its
        batch by get_world_size() asks twice as much after one of two workers left), so each epoch keeps its steps
        and a schedule sized by len(loader) its length; the driver is told where the two differ."""
        index, asked = self._loaders, batch_size * self.batch_workers
        self._loaders += 1
        fixed = self.global_batches[index] if index < len(self.global_batches) else None
        if self.context.world_rank == 0 and fixed != asked:  # new (the driver keeps it), or asked otherwise
            self.event_to("loader", {"index": index, "global_batch": fixed or asked, "asked": asked})
        return fixed or asked

    # ---- agreeing on a split ------------------------------------------------------------------------
    def gather(self, values: tuple[float, ...]) -> list[list[float]]:
        """`values` from every rank, by rank (one small collective; every rank calls it at the same point of its
        loop)."""
        if self.context.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(self.context.world_size)]
        dist.all_gather(everyone, mine)
        return [t.tolist() for t in everyone]

    # ---- reports ------------------------------------------------------------------------------------
    def report(self, metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
        """Hand `metrics` (and the checkpoint's files) to the driver; every rank stops here together when the run
        is to stop (the answer is rank 0's, sent to all)."""
        if not isinstance(metrics, dict):
            raise InputValueError(f"report(metrics={metrics!r}): give a dict of names to numbers")
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise InputValueError(f"report(checkpoint={checkpoint!r}): give a mixtrain.train.Checkpoint or None")
        self._reports += 1
        files = checkpoint.files() if checkpoint is not None else None
        stop = self.report_to(self.context.world_rank, self._reports, _plain(metrics), files)
        if self.context.world_size > 1:
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.broadcast(flag, 0)
            stop = bool(flag.item())
        if stop:
            raise LoopStopped()


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Numbers (tensors of one element read out), strings and bools; anything else by its repr."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        out[str(key)] = value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)
    return out


_current: LoopSession | None = None


def current(what: str) -> LoopSession:
    """The loop running in this process; a clear error for a call outside one."""
    if _current is None:
        raise RuntimeError(
            f"mixtrain.train.{what}() is for inside a training loop that mixtrain runs on its workers: pass the "
            "function to mixtrain.train.torch.TorchTrainer(train_func, ...).fit(), or run it with `mixtrain run`"
        )
    return _current


def start(session: LoopSession) -> None:
    global _current
    _current = session


def end() -> None:
    global _current
    _current = None
