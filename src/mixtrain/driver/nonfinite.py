"""Stopping a run whose steps are skipped as NaN/Inf (policies/decisions.py's NonFiniteStreak decides): past
RunConfig.max_nonfinite_steps in a row, and at its end when it applied none. No Ray."""

from __future__ import annotations

from mixtrain.driver.changes import TrainingStopped
from mixtrain.driver.checkpointing import Checkpoints
from mixtrain.group.port import GroupPort
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import NonFiniteStreak, Stop
from mixtrain.records.rounds import RoundRecord


class NonFiniteGuard:
    """Carries out the NonFiniteStreak's Stop: TrainingStopped naming who produced the NaN/Inf losses."""

    def __init__(self, streak: NonFiniteStreak, port: GroupPort, checkpoints: Checkpoints, log: RunLog) -> None:
        self.streak = streak
        self.port = port
        self.members = port.members
        self.checkpoints = checkpoints
        self.log = log

    def after_round(self, record: RoundRecord) -> None:
        """Count skipped (NaN/Inf) steps in a row; past the limit, stop and name who produced them."""
        decision = self.streak.observe(
            epoch=record.epoch,
            steps=record.steps,
            skipped_steps=record.skipped_steps,
            nonfinite_steps=record.nonfinite_steps,
            names=self.members.names(),
        )
        if isinstance(decision, Stop):
            raise TrainingStopped(
                f"training stopped: {decision.reason}. {self.checkpoints.resume_hint(self.port.scaling)}"
            )

    def at_end(self) -> None:
        """A run that ran steps but applied none (all NaN data) is a failure naming the cause, not "done" with its
        starting weights saved as if trained."""
        decision = self.streak.at_end(self.members.names())
        if isinstance(decision, Stop):
            self.log.write("untrained", {"reason": decision.reason})
            raise TrainingStopped(f"training failed: {decision.reason}")
