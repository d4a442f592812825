"""The loop's driver, as a small state machine: it decides what follows each attempt of the user's loop; the Ray
side (_trainer.py) carries it out behind a `LoopPort`, which the unit tests fake.

    BringUp(n) --each worker's device, the group formed--> Running(n)
    Running(n) --the loop returned on every worker--> Done
               --every worker stopped at a report, to go on without a slow one--> LeavingOut(n)
               --workers lost--> Lost(n)
               --Ctrl-C stopped every worker at its next report--> Interrupted
               --the loop raised on a worker--> Failed
    LeavingOut(n) --its bundle gets no worker again--> Restarting(n, that bundle)
    Lost(n) --within FailureConfig.max_failures--> Restarting(n)
            \\--more failures than that within the window, or no worker left--> Failed
    Restarting(n, excluded) --a new process in each bundle, from the newest checkpoint--> BringUp(n + 1)

`run()` is a loop over `step(state)`; each transition is one method and returns the next state. Failed and
Interrupted end it with TrainingFailedError and TrainingInterrupted, carrying the resume hint where one helps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mixtrain.driver.interrupt import TrainingInterrupted
from mixtrain.group.membership import Membership
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import FailureBudget, Stop
from mixtrain.train._result import TrainingFailedError


@dataclass(frozen=True)
class AttemptOutcome:
    """How one attempt of the loop ended, as the workers' answers say."""

    lost: dict[int, str] = field(default_factory=dict)
    """Workers lost (current rank -> what happened): dead, or silent past the grace after a peer failed."""
    stopped_at_report: bool = False
    """A worker stopped at a report because the driver asked (a slow worker to leave out, or Ctrl-C)."""
    interrupted: bool = False
    """Ctrl-C was pressed during the attempt and every worker was asked to stop at its next report."""
    raised: tuple[int, str] | None = None
    """(rank, traceback) of a loop that raised: the attempt ended there."""


class LoopPort(Protocol):
    """The loop's workers as the driver sees them: what it asks the Ray side to do, and nothing more."""

    @property
    def members(self) -> Membership:
        """Who runs the loop now, in rank order (changed by `restart`)."""
        ...

    @property
    def loop_name(self) -> str: ...

    @property
    def log_dir(self) -> Path | None:
        """Where each worker's output is written (None: nowhere)."""
        ...

    @property
    def resumes(self) -> bool:
        """The loop called get_checkpoint(): a restart goes on from the last checkpoint, not from the start."""
        ...

    def bring_up(self) -> None:
        """Each worker resolves its device and the collective group forms."""
        ...

    def run_attempt(self, attempt: int) -> AttemptOutcome:
        """The loop on every worker until it ends, its reports shown and recorded as they come."""
        ...

    def take_leaving(self) -> dict[str, Any]:
        """The worker the job is faster without ({"rank", "reason"}), which no longer stands once taken."""
        ...

    def restart(self, excluded: Sequence[int]) -> list[int]:
        """A new process in each bundle but the `excluded` ones; returns the bundles left empty (node gone)."""
        ...

    def reload_checkpoint(self) -> str | None:
        """The newest checkpoint the run reported, which the next attempt's get_checkpoint() gets (None: none)."""
        ...

    def last_checkpoint(self) -> str | None:
        """The last checkpoint reported, for the resume hint."""
        ...


@dataclass(frozen=True)
class BringUp:
    attempt: int


@dataclass(frozen=True)
class Running:
    attempt: int


@dataclass(frozen=True)
class LeavingOut:
    """Every worker stopped at a report with a checkpoint: the loop goes on from it without the slow worker."""

    attempt: int


@dataclass(frozen=True)
class Lost:
    attempt: int
    lost: dict[int, str]


@dataclass(frozen=True)
class Restarting:
    attempt: int
    excluded: tuple[int, ...] = ()
    """Bundles left out for being slow."""


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class Interrupted:
    message: str


State = BringUp | Running | LeavingOut | Lost | Restarting | Done | Failed | Interrupted


class LoopDriver:
    """One fit's attempts: brings the loop up, runs it, and after each attempt decides what follows."""

    def __init__(
        self,
        port: LoopPort,
        budget: FailureBudget,
        *,
        log: RunLog,
        view: ProgressView,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.port, self.budget, self.log, self.view, self.clock = port, budget, log, view, clock
        self.interrupted = False
        """Ctrl-C ended the run (its workers may be stopped quickly)."""

    def run(self) -> None:
        """Attempts until the loop finishes on every worker; raises where the run ends otherwise."""
        state: State = BringUp(0)
        while not isinstance(state, (Done, Failed, Interrupted)):
            state = self.step(state)
        if isinstance(state, Failed):
            raise TrainingFailedError(state.message)
        if isinstance(state, Interrupted):
            raise TrainingInterrupted(state.message, None)

    def step(self, state: State) -> State:
        """One transition."""
        if isinstance(state, BringUp):
            self.port.bring_up()
            return Running(state.attempt)
        if isinstance(state, Running):
            return self._running(state)
        if isinstance(state, LeavingOut):
            return self._leaving_out(state)
        if isinstance(state, Lost):
            return self._lost(state)
        if isinstance(state, Restarting):
            return self._restarting(state)
        raise AssertionError(f"no transition from {state}")

    # ---- transitions --------------------------------------------------------------------------
    def _running(self, at: Running) -> State:
        outcome = self.port.run_attempt(at.attempt)
        if outcome.raised is not None:
            return Failed(self._raised(*outcome.raised))
        if outcome.interrupted and not outcome.lost:
            self.interrupted = True
            self.log.write("interrupted", {"attempt": at.attempt})
            return Interrupted(f"stopped at a report. {self._hint()}")
        if outcome.lost:  # the others, stuck in a collective with a lost one, were stopped: all start again
            return Lost(at.attempt, outcome.lost)
        if outcome.stopped_at_report:
            return LeavingOut(at.attempt)
        return Done()

    def _lost(self, at: Lost) -> State:
        """Workers lost: counted against FailureConfig.max_failures (per hour), or the run stops here."""
        members = self.port.members
        decision = self.budget.record(len(members) - len(at.lost), self.clock())
        self.log.write("failure", {"attempt": at.attempt, "lost": at.lost, "failures": self.budget.failures})
        for rank, why in sorted(at.lost.items()):
            self.view.log(f"{members[rank].describe(rank)} lost: {why}")
        if isinstance(decision, Stop):
            return Failed(f"training stopped: {decision.reason}. {self._hint()}")
        self.view.log(self.budget.count())
        return Restarting(at.attempt)

    def _leaving_out(self, at: LeavingOut) -> State:
        """The worker the job is measurably faster without: its bundle gets no worker from now on."""
        leaving = self.port.take_leaving()
        rank = int(leaving["rank"])
        member = self.port.members[rank]
        self.log.write("left_out", {"attempt": at.attempt, "worker": member.info, "reason": leaving["reason"]})
        self.view.log(f"left out {member.describe(rank)}: {leaving['reason']}")
        return Restarting(at.attempt, (member.spec.rank,))

    def _restarting(self, at: Restarting) -> State:
        empty = self.port.restart(at.excluded)
        where = restart_from(self.port.reload_checkpoint(), self.port.resumes)
        self.view.log(
            f"the loop starts again on {len(self.port.members)} workers {where}"
            + (f"; bundles {empty} have no worker now" if empty else "")
        )
        return BringUp(at.attempt + 1)

    # ---- messages -----------------------------------------------------------------------------
    def _raised(self, rank: int, error: str) -> str:
        """The worker that raised, its device and traceback, and where every worker's output is."""
        log_dir = self.port.log_dir
        logs = f"\n(each worker's output: {log_dir}/worker-*.log)" if log_dir else ""
        return f"{self.port.members[rank].describe(rank)} raised in {self.port.loop_name}:\n{error.rstrip()}{logs}"

    def _hint(self) -> str:
        last = self.port.last_checkpoint()
        if last is None:
            return "No checkpoint was reported."
        run_dir = self.log.run_dir
        return (
            f"The last checkpoint, {last}, is intact; continue with RunConfig(name={run_dir.name!r}) (the same "
            f"storage_path), or `mixtrain run ... --resume {run_dir}`."
        )


def restart_from(checkpoint: str | None, resumes: bool) -> str:
    """Where a restarted loop goes on from, as the terminal says it: a loop that never called get_checkpoint()
    trains again from its first epoch, whatever checkpoints it reported (said so, not hidden behind one)."""
    if checkpoint is None:
        return "from the start (no checkpoint reported yet)"
    if not resumes:
        return (
            f"from the start: the loop never calls mixtrain.train.get_checkpoint(), so it trains its first epochs "
            f"again (its last checkpoint, {checkpoint}, is kept)"
        )
    return f"from {checkpoint}"
