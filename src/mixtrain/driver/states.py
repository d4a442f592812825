"""The controller's named states (driver/controller.py carries out the transitions between them). No Ray, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from mixtrain.group.port import RoundOutcome
from mixtrain.records.messages import RoundPlan
from mixtrain.records.rounds import RoundRecord

Position = tuple[int, int]
"""(epoch, step): where training continues."""


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
