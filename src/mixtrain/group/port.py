"""What the controller asks of the worker group, and nothing more: the seam between the driver's decisions (no Ray)
and the Ray side that carries them out (group/group_ops.py). The controller's unit tests stand a fake behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mixtrain.config import ScalingConfig
from mixtrain.group.membership import Member, Membership
from mixtrain.records.messages import RoundPlan, WorkerReport


class WorkersLost(Exception):
    """Workers were lost during a call between rounds (a checkpoint, an evaluation): dead, or silent past its
    deadline. `lost`: current rank -> what happened. The controller re-forms the group without them."""

    def __init__(self, lost: dict[int, str]) -> None:
        super().__init__(f"workers lost: {lost}")
        self.lost = lost


@dataclass
class RoundOutcome:
    """Every worker's report of a round, by rank, and the workers lost in it (rank -> what happened)."""

    reports: dict[int, WorkerReport]
    lost: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.lost) or any(r.peer_lost for r in self.reports.values())


@dataclass
class Joined:
    """Replacements that joined between rounds (now the last ranks, measured), and notes on those refused."""

    members: list[Member]
    refused: list[str]


class GroupPort(Protocol):
    """The worker group as the controller sees it. Every change of who is in goes through here, and lands in
    `members` (the one record of who is in)."""

    @property
    def members(self) -> Membership: ...

    @property
    def scaling(self) -> ScalingConfig: ...

    @property
    def shards_optimizer(self) -> bool: ...

    @property
    def form_s(self) -> float:
        """Seconds the group's last formation took (rendezvous and join): the measured price of re-forming it."""
        ...

    def run_round(self, plan: RoundPlan) -> RoundOutcome:
        """Every active worker runs the round; lost workers are reported, not raised."""
        ...

    def leave_out(
        self,
        ranks: Sequence[int],
        *,
        recover: dict[int, int] | None = None,
        lost: bool = False,
        restore: dict[str, Any] | None = None,
        park: bool = False,
    ) -> None:
        """`ranks` leave the group and it re-forms with the rest (group_ops.GroupOps.leave_out says how)."""
        ...

    def readmit(self) -> Member:
        """The parked member rejoins as the last rank, with rank 0's current state."""
        ...

    def release_parked(self) -> None: ...

    def start_replacements(self) -> None: ...

    def admit(self, global_batch: int) -> Joined: ...

    def full_state(self) -> dict[str, Any]:
        """Rank 0's training state (a sharded optimizer's slices merged in), unpacked. Raises WorkersLost."""
        ...

    def rng_states(self) -> list[dict[str, Any]]:
        """Every rank's random streams. Raises WorkersLost."""
        ...

    def rank_states(self) -> list[dict[str, Any]]:
        """Every rank's state of its own (local SGD's inner optimizer and error feedback), by rank; empty where
        the replicas hold the same. Raises WorkersLost."""
        ...

    def evaluate(
        self, bounds: Sequence[tuple[int, int]], batches: Sequence[int], timeout_s: float
    ) -> list[dict[str, float]]:
        """Held-out sums per rank over its [start, stop), in batches of at most its `batches` entry (an empty
        slice: no sums). Raises WorkersLost."""
        ...
