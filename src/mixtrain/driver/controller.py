"""The driver's loop, as a small state machine. Workers do the steps; the policies decide (policies/decisions.py);
the controller carries their decisions out between rounds.

    Train(epoch, step) --a round--> RoundDone --(pace, balance, evaluate, checkpoint, admit)--> Train(epoch, step + n)
          |                \\--a worker lost or out of memory--> RoundFailed --(recover)--> Train(where it goes on)
          |--the epoch's steps are done--> EpochEnd --(evaluate, checkpoint)--> Train(epoch + 1, 0) or Done
          |--max_steps reached, or a callback raised StopTraining--> Finishing --(evaluate, checkpoint)--> Done
          \\--Ctrl-C--> Stopping --(checkpoint)--> raises TrainingInterrupted

`run()` is a loop over `step(state)`; each transition is one method and returns the next state. Every record the
controller writes passes the user's callbacks (driver/hooks.py) on its way to metrics.jsonl. Recovery is a
transition too: a lost worker (in a round, a checkpoint or an evaluation) leads to where training goes on, the
last checkpoint included. No Ray here: the group is a `GroupPort` (group/port.py), which the tests fake.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixtrain.checkpoint import CheckpointStore
from mixtrain.data.sampling import steps_per_epoch
from mixtrain.driver.balancing import Balancing
from mixtrain.driver.caps import CapWatch
from mixtrain.driver.changes import Changes, TrainingStopped
from mixtrain.driver.checkpointing import Checkpointer, Checkpoints
from mixtrain.driver.evaluator import Evaluator
from mixtrain.driver.hooks import Hooks
from mixtrain.driver.interrupt import GracefulStop, TrainingInterrupted
from mixtrain.driver.nonfinite import NonFiniteGuard
from mixtrain.driver.schedule import Steps
from mixtrain.driver.states import Done, EpochEnd, Finishing, RoundDone, RoundFailed, State, Stopping, Train
from mixtrain.group.port import GroupPort
from mixtrain.observe.progress import ProgressView, state_memory_line
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import Adopt, FailureBudget, LeaveOut, NonFiniteStreak, Readmit, Rebalancer
from mixtrain.records.rounds import RoundRecord, epoch_line, plan_round, round_samples, round_steps, summarize_round
from mixtrain.records.run_state import RunSettings
from mixtrain.records.tunables import Tunables

__all__ = ["Controller", "Policies", "TrainingStopped"]


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
        self.evaluator = Evaluator(port, settings, tunables, self.steps, self.changes, log=log, view=view)
        self.evals: list[dict[str, Any]] = self.evaluator.evals
        self.checkpointer = Checkpointer(port, self.checkpoints, self.steps, self.changes, self.hooks)
        self.nonfinite = NonFiniteGuard(policies.nonfinite, port, self.checkpoints, log)
        self.caps = CapWatch(settings.memory_caps, log, view)
        self.stopped_early: str | None = None
        self.round_steps = round_steps(settings, tunables.round_target_s)
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
        if self.port.shards_optimizer and self.checkpoints.enabled:  # a lost worker takes its optimizer slice along
            state = self.checkpointer.write(start) or state  # a checkpoint first is the way back
        while not isinstance(state, Done):
            state = self.step(state)
        self.nonfinite.at_end()

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
        num_steps = self.steps.round_length(at.epoch, at.step, self.round_steps)
        members, at_step = self.members, (at.epoch, at.step)
        plan = plan_round(members.shares(), members.memory_caps(), self.settings, at_step, num_steps, len(self.history))
        outcome = self.port.run_round(plan)
        if outcome.failed:
            return RoundFailed(plan, outcome)
        record = summarize_round(plan, list(outcome.reports.values()), outcome.wall_s)
        self._record(record, sorted(outcome.reports))
        return RoundDone(plan, record)

    def _round_done(self, done: RoundDone) -> State:
        """After a good round: the NaN streak, pacing and shares, a checkpoint when due, replacements."""
        record, plan = done.record, done.plan
        self.nonfinite.after_round(record)
        self.caps.after_round(record, [m.spec.rank for m in self.members.active])
        if len(self.history) == 1:  # the optimizer state exists now: say what each replica holds
            self.view.log(state_memory_line(record.as_dict()))
        if len(self.history) > 1:  # the first round is warm-up (allocations, caches), not a measurement
            self.balancing.measure(record)
            self._balance(record)
        at = (plan.epoch, plan.first_step + plan.num_steps)
        if at[1] < self.num_steps:  # (the epoch's end evaluates and checkpoints in its own transition)
            rewound = self._evaluate_and_checkpoint(at, at) if self.evaluator.due(*at) else self.checkpointer.save(at)
            if rewound is not None:
                return rewound
        if self.settings.rejoin and self.policies.budget.failures:
            self.changes.admit(at)
        step_s = record.wall_s / plan.num_steps
        self.round_steps = round_steps(self.settings, self.tunables.round_target_s, len(self.history), step_s)
        return Train(*at)

    def _round_failed(self, failed: RoundFailed) -> State:
        """The survivors keep the steps they committed; one out of memory goes on with a smaller micro-batch, a
        lost one is recovered from (training goes on where the membership change says)."""
        plan, outcome = failed.plan, failed.outcome
        committed = {r: rep.committed_steps for r, rep in outcome.reports.items()}
        kept = max(committed.values(), default=0)
        if kept:
            partial = (kept, round_samples(plan, kept, self.settings.num_samples))
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
        line = epoch_line(self.history, epoch, self.epochs)
        if self.evaluator.due(epoch, self.num_steps, bool(last)):
            rewound = self._evaluate_and_checkpoint((epoch, self.num_steps), after, line)
        else:
            self.view.log(line)  # (a checkpoint written here once hid the epoch's line: the last one never showed)
            rewound = self.checkpointer.write(after) if self.checkpointer.due(after, bool(last)) else None
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
        if self.evaluator.due(*at, last=True):
            rewound = self._evaluate_and_checkpoint(at, at)
        else:
            rewound = self.checkpointer.save(at, last=True)
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
        rewound = self.checkpointer.save(at, last=True)
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
        checkpoint continuing at `at`. None, or where training goes on after a rewind."""
        ev = self.evaluator.run(where, at, line)
        return ev if isinstance(ev, Train) else self.checkpointer.after_evaluation(ev, at)

    def _record(self, record: RoundRecord, ranks: list[int]) -> None:
        record.name_workers([self.members[rank].info for rank in ranks])
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

    def load_driver_state(self, saved: Any) -> None:
        """The callbacks' state and the best checkpoint, from the checkpoint a run resumes from."""
        self.checkpointer.load_driver_state(saved)

    @property
    def best_checkpoint(self) -> Path | None:
        """The best checkpoint's folder (RunConfig.keep_best), when it is still there."""
        return self.checkpoints.best_path
