"""The driver's loop, as a small state machine. Workers do the steps; the policies decide (policies/decisions.py);
the controller carries their decisions out between rounds.

    Train(epoch, step) --a round--> RoundDone --(pace, balance, evaluate, checkpoint, admit)--> Train(epoch, step + n)
          |                \\--a worker lost or out of memory--> RoundFailed --(recover)--> Train(where it goes on)
          |--the epoch's steps are done--> EpochEnd --(evaluate, checkpoint)--> Train(epoch + 1, 0) or Done
          |--max_steps reached, or a callback raised StopTraining--> Finishing --(evaluate, checkpoint)--> Done
          \\--Ctrl-C--> Stopping --(checkpoint)--> raises TrainingInterrupted

`run()` is a loop over `step(state)`; each transition is one method and returns the next state. Every record the
controller writes passes the user's callbacks (core/hooks.py) on its way to metrics.jsonl. Recovery is a
transition too: a lost worker (in a round, a checkpoint or an evaluation) leads to where training goes on, the
last checkpoint included. No Ray here: the group is a `GroupPort` (core/port.py), which the tests fake.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mixtrain.callbacks import EVAL_KEYS
from mixtrain.checkpoint import CheckpointStore, checkpoint_name
from mixtrain.core import evaluation
from mixtrain.core.balancing import Balancing
from mixtrain.core.changes import Changes, TrainingStopped
from mixtrain.core.hooks import Hooks
from mixtrain.core.interrupt import GracefulStop, TrainingInterrupted
from mixtrain.core.messages import RoundPlan
from mixtrain.core.port import GroupPort, RoundOutcome, WorkersLost
from mixtrain.core.rounds import RoundRecord, next_round_steps, summarize_round, whole_exchanges
from mixtrain.core.run_state import RunSettings
from mixtrain.core.schedule import Checkpoints, Steps, eval_batches, eval_split
from mixtrain.core.tunables import Tunables
from mixtrain.data.sampling import steps_per_epoch
from mixtrain.errors import InputValueError
from mixtrain.observe.progress import ProgressView, state_memory_line
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import Adopt, FailureBudget, LeaveOut, NonFiniteStreak, Readmit, Rebalancer, Stop
from mixtrain.policies.planner import micro_batches

__all__ = ["Controller", "Policies", "TrainingStopped"]

RAMP_FIRST_S = 0.2
"""Length of the first measured round; each next one doubles, up to MIXTRAIN_ROUND_TARGET_S."""
T = TypeVar("T")


@dataclass(frozen=True)
class Train:
    """Train from (epoch, step): a round, or the epoch's end when its steps are done."""

    epoch: int
    step: int


@dataclass(frozen=True)
class RoundDone:
    plan: RoundPlan
    record: RoundRecord


@dataclass(frozen=True)
class RoundFailed:
    """A worker was lost (or ran out of memory) in the round; `outcome` holds what each survivor committed."""

    plan: RoundPlan
    outcome: RoundOutcome


@dataclass(frozen=True)
class EpochEnd:
    epoch: int


@dataclass(frozen=True)
class Stopping:
    """Ctrl-C (or SIGTERM) was pressed: stop at (epoch, step) with a checkpoint."""

    epoch: int
    step: int


@dataclass(frozen=True)
class Finishing:
    """The run ends inside an epoch, at (epoch, step): max_steps reached, or a callback raised StopTraining."""

    epoch: int
    step: int


@dataclass(frozen=True)
class Done:
    pass


State = Train | RoundDone | RoundFailed | EpochEnd | Finishing | Stopping | Done


@dataclass(frozen=True)
class Policies:
    """The decisions the controller asks for, passed in (and never written from outside)."""

    rebalancer: Rebalancer
    budget: FailureBudget
    nonfinite: NonFiniteStreak

    @classmethod
    def for_run(cls, settings: RunSettings, tunables: Tunables) -> Policies:
        return cls(
            rebalancer=Rebalancer(
                global_batch=settings.global_batch,
                leave_out_slow=settings.leave_out_slow,
                threshold=tunables.rebalance_threshold,
                min_gain=tunables.exclude_gain,
                payback_s=tunables.leave_out_payback_s,
            ),
            budget=FailureBudget(settings.max_failures, tunables.failure_window_s),
            nonfinite=NonFiniteStreak(settings.max_nonfinite_steps),
        )


class Controller:
    def __init__(
        self,
        port: GroupPort,
        settings: RunSettings,
        tunables: Tunables,
        policies: Policies,
        *,
        log: RunLog,
        view: ProgressView,
        checkpoints: CheckpointStore | None = None,
        stop: GracefulStop | None = None,
        hooks: Hooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.port = port
        self.members = port.members
        self.settings = settings
        self.tunables = tunables
        self.policies = policies
        self.hooks = hooks or Hooks()
        """The user's callbacks: they hear every record written to `log`, and may ask the run to stop."""
        log = self.hooks.watch(log)  # type: ignore[assignment]
        self.log = log
        self.view = view
        self.stop = stop
        """Ctrl-C / SIGTERM asks for a stop at the next round boundary."""
        self.history: list[RoundRecord] = []
        self.evals: list[dict[str, Any]] = []
        self.checkpoints = Checkpoints(checkpoints, settings, log=log, view=view, clock=clock)
        self.balancing = Balancing(self.members, policies.rebalancer, balanced=settings.balanced)
        self.changes = Changes(
            port,
            settings,
            balancing=self.balancing,
            budget=policies.budget,
            checkpoints=self.checkpoints,
            history=self.history,
            log=log,
            view=view,
            clock=clock,
        )
        self.num_steps = steps_per_epoch(settings.num_samples, settings.global_batch)
        self.steps = Steps(self.num_steps, 0, settings.max_steps, settings.eval_every, bool(settings.num_eval))
        self.evaluated_at: int | None = None
        """The global step of the last evaluation (none twice at one step)."""
        self.stopped_early: str | None = None
        # a short first round measures the step time (local SGD: H steps, the shortest without an early exchange)
        first = settings.steps_per_round or max(2, settings.min_round_steps)
        self.round_steps = whole_exchanges(first, settings.steps_per_exchange)
        self.started_at = 0.0
        """time.perf_counter() when run() began: the first step."""

    @property
    def epochs(self) -> int:
        return self.steps.epochs

    @epochs.setter
    def epochs(self, epochs: int) -> None:
        self.steps.epochs = epochs

    def global_step(self, epoch: int, step: int) -> int:
        return self.steps.at(epoch, step)

    @property
    def last_checkpoint(self) -> Any:
        return self.checkpoints.last

    def run(self, epochs: int, start: tuple[int, int] = (0, 0)) -> None:
        """Train until `epochs` epochs are done, starting at (epoch, step) `start` (a resumed run)."""
        self.checkpoints.restart_clock()
        self.started_at = time.perf_counter()
        self.epochs = epochs
        state: State = Train(*start)
        if self.port.shards_optimizer and self.checkpoints.enabled:
            state = self._checkpoint(start) or state  # a lost worker takes its optimizer slice along: the way back
        while not isinstance(state, Done):
            state = self.step(state)

    def step(self, state: State) -> State:
        """One transition."""
        if isinstance(state, Train):
            return self._train(state)
        if isinstance(state, RoundDone):
            return self._round_done(state)
        if isinstance(state, RoundFailed):
            return self._round_failed(state)
        if isinstance(state, EpochEnd):
            return self._epoch_end(state)
        if isinstance(state, Finishing):
            return self._finishing(state)
        if isinstance(state, Stopping):
            return self._stopping(state)
        raise AssertionError(f"no transition from {state}")

    # ---- transitions --------------------------------------------------------------------------
    def _train(self, at: Train) -> State:
        if self.stop is not None and self.stop.requested:
            return Stopping(at.epoch, at.step)
        if at.step >= self.num_steps:
            return EpochEnd(at.epoch)
        if self.hooks.stop_reason is not None or self.global_step(at.epoch, at.step) >= self.steps.last:
            return Finishing(at.epoch, at.step)
        plan = self._round_plan(at, self.steps.round_length(at.epoch, at.step, self.round_steps))
        outcome = self.port.run_round(plan)
        if outcome.failed:
            return RoundFailed(plan, outcome)
        record = summarize_round(plan, list(outcome.reports.values()), outcome.wall_s)
        self._record(record, sorted(outcome.reports))
        return RoundDone(plan, record)

    def _round_done(self, done: RoundDone) -> State:
        """After a good round: the NaN streak, pacing and shares, a checkpoint when due, replacements."""
        record, plan = done.record, done.plan
        self._check_nonfinite(record)
        if len(self.history) == 1:  # the optimizer state exists now: say what each replica holds
            self.view.log(state_memory_line(record.as_dict()))
        if len(self.history) > 1:  # the first round is warm-up (allocations, caches), not a measurement
            self.balancing.measure(record)
            self._balance(record)
        at = (plan.epoch, plan.first_step + plan.num_steps)
        if at[1] < self.num_steps and self.steps.eval_due(*at):
            rewound = self._evaluate_and_checkpoint(at, at)
            if rewound is not None:
                return rewound
        elif at[1] < self.num_steps and self.checkpoints.due():
            rewound = self._checkpoint(at)
            if rewound is not None:
                return rewound
        if self.settings.rejoin and self.policies.budget.failures:
            self.changes.admit(at)
        # Rounds start short and double up to the target: the first decisions (shares, leaving a worker out,
        # checking that call) come within a second or two instead of after several full rounds.
        target = min(self.tunables.round_target_s, RAMP_FIRST_S * 2 ** (len(self.history) - 1))
        self.round_steps = next_round_steps(
            record.wall_s / plan.num_steps,
            target,
            self.settings.steps_per_round,
            per_exchange=self.settings.steps_per_exchange,
            min_steps=self.settings.min_round_steps,
        )
        return Train(*at)

    def _round_failed(self, failed: RoundFailed) -> State:
        """The survivors keep the steps they committed; one out of memory goes on with a smaller micro-batch, a
        lost one is recovered from (training goes on where the membership change says)."""
        plan, outcome = failed.plan, failed.outcome
        committed = {r: rep.committed_steps for r, rep in outcome.reports.items()}
        kept = max(committed.values(), default=0)
        if kept:
            partial = (kept, self._samples(plan, kept))
            self._record(
                summarize_round(plan, list(outcome.reports.values()), outcome.wall_s, partial), sorted(committed)
            )
        at = (plan.epoch, plan.first_step + kept)
        out_of_memory = sorted(r for r, rep in outcome.reports.items() if rep.out_of_memory)
        if out_of_memory and not outcome.lost:
            self.changes.out_of_memory(out_of_memory, plan, committed, at[1])
            return Train(*at)
        return Train(*self.changes.recover(outcome.lost, outcome.reports, at, committed))

    def _epoch_end(self, end: EpochEnd) -> State:
        """The epoch's line; an evaluation when one is due here; then a checkpoint (after the evaluation, so it
        holds what the callbacks and the best checkpoint made of it, and a resumed run goes on counting)."""
        epoch, after = end.epoch, (end.epoch + 1, 0)
        last = epoch + 1 >= self.epochs or self.global_step(*after) >= self.steps.last or self.hooks.stop_reason
        rounds = [r for r in self.history if r.epoch == epoch and not r.superseded]
        line = f"epoch {epoch + 1}/{self.epochs}:"
        if rounds:  # none when a run resumed exactly at this epoch's end (a Ctrl-C after its last round)
            samples, wall = sum(r.samples for r in rounds), sum(r.wall_s for r in rounds)
            line += f" loss {rounds[-1].last_loss:.4f}  {samples / wall:,.0f} samples/s"
        if self.steps.eval_due(epoch, self.num_steps) or (last and self.settings.num_eval):
            rewound = self._evaluate_and_checkpoint((epoch, self.num_steps), after, line)
        elif self.checkpoints.due_at_epoch_end(epoch, self.epochs) or (last and self.checkpoints.enabled):
            rewound = self._checkpoint(after)
        else:
            rewound = None
            self.view.log(line)
        if rewound is not None:
            return rewound
        if last:
            self._stopped_early(*after)
            return Done()
        return Train(*after)

    def _finishing(self, end: Finishing) -> State:
        """max_steps reached inside an epoch, or a callback's StopTraining: an evaluation and a checkpoint here
        (a resume with a larger max_steps goes on from this step), then done."""
        at = (end.epoch, end.step)
        if self.settings.num_eval:
            rewound = self._evaluate_and_checkpoint(at, at)
        else:
            rewound = self._checkpoint(at) if self.checkpoints.enabled and self.checkpoints.at != at else None
        if rewound is not None:
            return rewound
        self._stopped_early(*at)
        return Done()

    def _stopped_early(self, epoch: int, step: int) -> None:
        """Say why the run ends here when a callback asked (Result.stopped_early) or max_steps ends an epoch."""
        where = f"epoch {epoch}, step {step} (global step {self.global_step(epoch, step)})"
        reason = self.hooks.stop_reason
        if reason is not None:
            self.stopped_early = reason
            self.log.write("stopped_early", {"epoch": epoch, "step": step, "reason": reason})
            self.view.log(f"stopped at {where}: {reason}")
        elif step and step < self.num_steps:
            self.view.log(f"RunConfig.max_steps={self.settings.max_steps} reached at {where}")

    def _stopping(self, stop: Stopping) -> State:
        """Ctrl-C: a checkpoint here (unless one was just written here), then stop with the resume command."""
        at = (stop.epoch, stop.step)
        if self.checkpoints.enabled and self.checkpoints.at != at:
            rewound = self._checkpoint(at)
            if rewound is not None:
                return rewound
        self.log.write("interrupted", {"epoch": at[0], "step": at[1], "checkpoint": str(self.checkpoints.last)})
        raise TrainingInterrupted(
            f"stopped at epoch {at[0]}, step {at[1]}. {self.checkpoints.resume_hint(self.port.scaling)}",
            self.checkpoints.last,
        )

    # ---- what the transitions share -------------------------------------------------------------
    def _evaluate_and_checkpoint(self, where: tuple[int, int], at: tuple[int, int], line: str = "") -> Train | None:
        """The held-out metrics after `where` = (epoch, steps done in it), shown after `line` (the epoch's), then a
        checkpoint continuing at `at` (marked best when RunConfig.keep_best says so). None, or where training
        goes on after a rewind."""
        ev = self._evaluated(where, at, line)
        if isinstance(ev, Train):
            return ev
        best = self._is_best(ev, at)
        if not self.checkpoints.enabled or (self.checkpoints.at == at and not best):
            return None
        return self._checkpoint(at, best=best)

    def _evaluated(self, where: tuple[int, int], at: tuple[int, int], line: str) -> dict[str, Any] | Train | None:
        step = self.global_step(*where)
        if self.evaluated_at == step:  # an epoch's end that is also an eval_every point
            if line:
                self.view.log(line)
            return None
        ev = self._tolerant("evaluate", self.evaluate, at)
        if isinstance(ev, Train):
            return ev
        ev.update(epoch=where[0], step=where[1], global_step=step)
        self.evaluated_at = step
        self.evals.append(ev)
        self.log.write("eval", ev)
        line = f"{line}  held-out loss" if line else f"held-out after step {step}: loss"
        line += f" {ev['loss']:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in ev.items() if k not in ("loss", *EVAL_KEYS))
        self.view.log(line)
        return ev

    def _is_best(self, ev: dict[str, Any] | None, at: tuple[int, int]) -> bool:
        best = self.checkpoints.best
        if best is None or ev is None:
            return False
        try:
            return best.improved(ev)
        except InputValueError as exc:  # the metric is not there: say so once a checkpoint holds the training
            if self.checkpoints.enabled and self.checkpoints.at != at:
                self._checkpoint(at)
            raise InputValueError(f"{exc}. {self.checkpoints.resume_hint(self.port.scaling)}") from None

    def _round_plan(self, at: Train, num_steps: int) -> RoundPlan:
        return RoundPlan(
            epoch=at.epoch,
            first_step=at.step,
            num_steps=num_steps,
            shares=tuple(self.members.shares()),
            global_batch=self.settings.global_batch,
            drift_tolerance=self.settings.drift_tolerance,
            micro_batches=tuple(micro_batches(self.members.shares(), self.members.memory_caps())),
            round_index=len(self.history),
        )

    def _samples(self, plan: RoundPlan, num_steps: int) -> int:
        """Training samples in `num_steps` steps from the round's first (the epoch's last step may be short)."""
        first, batch = plan.first_step, self.settings.global_batch
        return sum(min(batch, self.settings.num_samples - t * batch) for t in range(first, first + num_steps))

    def _record(self, record: RoundRecord, ranks: list[int]) -> None:
        for entry, rank in zip(record.workers, ranks):  # who, for the report and progress rows
            info = self.members[rank].info
            if info is not None:
                entry.name(info)
        self.history.append(record)
        as_dict = record.as_dict()
        self.log.write("round", as_dict)
        self.view.round_done(as_dict)
        if record.rebroadcast:
            self.view.log(f"replicas drifted by {record.drift:.2e}: rank 0's weights re-broadcast")

    def _balance(self, record: RoundRecord) -> None:
        steps_left = (self.epochs - record.epoch) * self.num_steps - (record.first_step + record.num_steps)
        remaining = max(0, steps_left) * self.settings.global_batch
        decision = self.balancing.decide(record, remaining, reform_s=self.port.form_s)
        if isinstance(decision, LeaveOut):
            self.changes.leave_out(decision.rank, decision.reason)
        elif isinstance(decision, Readmit):
            self.changes.readmit(decision.reason)
        elif isinstance(decision, Adopt):
            self.changes.adopt(decision.plan, f"re-planned after round {len(self.history)}")
        if self.balancing.confirmed:
            self.changes.confirm_leave_out()

    def _check_nonfinite(self, record: RoundRecord) -> None:
        """Count skipped (NaN/Inf) steps in a row; past the limit, stop and name who produced them."""
        decision = self.policies.nonfinite.observe(
            epoch=record.epoch,
            steps=record.steps,
            skipped_steps=record.skipped_steps,
            nonfinite_steps=record.nonfinite_steps,
            names=[f"worker {i} ({w.device_name} on {w.host}, {w.device})" for i, w in enumerate(self.members.infos())],
        )
        if isinstance(decision, Stop):
            raise TrainingStopped(
                f"training stopped: {decision.reason}. {self.checkpoints.resume_hint(self.port.scaling)}"
            )

    def _checkpoint(self, at: tuple[int, int], best: bool = False) -> Train | None:
        """Rank 0's training state, every rank's random streams and the driver's own (callbacks, best checkpoint),
        to continue at `at`. A worker lost meanwhile is recovered from first; None, or where training goes on when
        that took it back to the last checkpoint. `best`: kept beside the newest ones (RunConfig.keep_best)."""
        state = self._tolerant("checkpoint", self._collect_state, at)
        if isinstance(state, Train):
            return state
        state["driver"] = self.driver_state(checkpoint_name(self.global_step(*at)) if best else None)
        self.checkpoints.write(at, state, self.members, self.num_steps, best=best)
        return None

    def _collect_state(self) -> dict[str, Any]:
        state = self.port.full_state()
        state["rng"] = self.port.rng_states()
        ranks = self.port.rank_states()
        if ranks:
            state["ranks"] = ranks
        return state

    def driver_state(self, new_best: str | None = None) -> str:
        """What the driver keeps in a checkpoint beside the workers' state, as JSON; `new_best`: the name of the
        checkpoint it goes into, when that one is the new best."""
        best = self.checkpoints.best
        kept = None if best is None else {**best.state(), **({"name": new_best} if new_best else {})}
        return json.dumps({"callbacks": self.hooks.state(), "best": kept})

    def load_driver_state(self, saved: Any) -> None:
        """The callbacks' state and the best checkpoint, from a checkpoint's driver_state(). (A checkpoint at an
        evaluation is written after it, and a resumed run starts with a round: nothing is evaluated twice.)"""
        try:
            driver = json.loads(saved) if isinstance(saved, str) else {}
        except ValueError:
            driver = {}
        if not isinstance(driver, dict):
            driver = {}
        self.hooks.load_state(driver.get("callbacks"))
        self.checkpoints.load_best(driver.get("best"))

    @property
    def best_checkpoint(self) -> Path | None:
        """The best checkpoint's folder (RunConfig.keep_best), when it is still there."""
        return self.checkpoints.best_path

    def _tolerant(self, what: str, call: Callable[[], T], at: tuple[int, int]) -> T | Train:
        """`call()` (a checkpoint, an evaluation), surviving workers lost while it runs: re-form the group without
        them and call again; or, when the recovery went back to the last checkpoint, where training goes on."""
        while True:
            try:
                return call()
            except WorkersLost as exc:
                self.view.log(f"a worker was lost during {what}()")
                where = self.changes.recover(exc.lost, {}, at)
            if where != at:
                return Train(*where)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, each worker taking a contiguous slice of the eval set sized by its speed
        (schedule.eval_split) in batches its memory allows; what a worker could not fit goes to the others."""
        bounds, timeout = eval_split(
            self.settings.num_eval,
            len(self.members),
            self.members.speeds(),
            self.tunables.collective_timeout_s,
            self.tunables.round_timeout_s,
        )
        batches = eval_batches(self.members.memory_caps())
        parts = self.port.evaluate(bounds, batches, timeout)
        passes, note = evaluation.leftovers(parts, bounds)
        if note:
            self.view.log(note)
            self.log.write("eval_out_of_memory", {"note": note})
        for slices in passes:
            parts += self.port.evaluate(slices, batches, timeout)
        return evaluation.summarize(parts)
