"""Who is in the run: one `Member` record per worker process, owned by one `Membership`.

Every per-worker fact lives in its member: the proxy to its process, its placement bundle (`spec`), what it
built and reported, its share of the global batch, its memory cap, its measured speed, and its status. Ranks are
not stored: a worker's rank is its place among the active members, so leaving a worker out or taking one in
renumbers everyone at once and nothing has to be renumbered by hand. `Membership` is the only place that adds,
parks, takes back, drops or loses a member; everything else asks it. No Ray here (the proxy is opaque), so the
controller's tests build a membership of fakes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mixtrain.cluster.placement import WorkerSpec
from mixtrain.config import ScalingConfig
from mixtrain.records.messages import BuildReport, ProbeResult, WorkerInfo


def user_cap(scaling: ScalingConfig, spec: WorkerSpec) -> int | None:
    """The user's max_micro_batch for this worker (by its starting rank), or None: measure it."""
    return scaling.max_micro_batch[spec.rank] if scaling.max_micro_batch else None


class Status(enum.Enum):
    ACTIVE = "active"
    """In the collective group, training."""
    PARKED = "parked"
    """Left out mid-run by measurement, its process kept: taken back if the job turns out slower without it."""
    SPARE = "spare"
    """Left out for good but kept alive, idle, to be kept with the others for the next fit (keep_workers)."""
    JOINING = "joining"
    """A replacement building its replica in a lost worker's bundle; admitted at a round boundary."""
    GONE = "gone"
    """Stopped: lost, left out for good, or a replacement refused."""


@dataclass(eq=False)
class Member:
    """One worker process and what the driver knows of it."""

    worker: Any
    """The typed proxy to its process (group/worker_calls.py: WorkerCalls)."""
    spec: WorkerSpec
    """Its Ray bundle; `spec.rank` is the rank it started with (how the user's per-worker settings are found)."""
    status: Status = Status.ACTIVE
    info: WorkerInfo | None = None
    """Node, device, precision: what it reported once it had built its replica."""
    report: BuildReport | None = None
    probe: ProbeResult | None = None
    share: int = 0
    """Samples of each global batch it trains."""
    memory_cap: int | None = None
    """The largest micro-batch it runs (None: its whole share)."""
    speed: float | None = None
    """Compute samples/s: the probe's, then smoothed over measured rounds."""
    building: Any = None
    """A replacement's pending build (an object ref), until it is admitted."""

    def describe(self, rank: int | None = None) -> str:
        """For one-line messages: 'worker 1 (Apple M2 on 10.0.0.3)'."""
        if self.info is None:
            return f"worker {self.spec.rank if rank is None else rank} ({self.spec.device})"
        return self.info.short(rank)


class Membership:
    """The run's members, in rank order among the active ones. The one place that changes who is in."""

    def __init__(self, members: Sequence[Member] = ()) -> None:
        self._members: list[Member] = list(members)
        self.vacant: list[WorkerSpec] = []
        """Bundles of lost workers, where a replacement may start (a node that comes back, a restarted process)."""

    # ---- reading ------------------------------------------------------------------------------
    @property
    def active(self) -> list[Member]:
        """The members in the group, in rank order (a member's rank is its index here)."""
        return [m for m in self._members if m.status is Status.ACTIVE]

    def __len__(self) -> int:
        return len(self.active)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.active)

    def __getitem__(self, rank: int) -> Member:
        return self.active[rank]

    def rank_of(self, member: Member) -> int:
        return self.active.index(member)

    def with_status(self, status: Status) -> list[Member]:
        return [m for m in self._members if m.status is status]

    @property
    def parked(self) -> Member | None:
        """The member parked last (one at a time: a parked worker is either taken back or released)."""
        parked = self.with_status(Status.PARKED)
        return parked[-1] if parked else None

    @property
    def alive(self) -> list[Member]:
        """Every member with a process: active, parked, spare and joining."""
        return [m for m in self._members if m.status is not Status.GONE]

    def shares(self) -> list[int]:
        return [m.share for m in self.active]

    def memory_caps(self) -> list[int | None]:
        return [m.memory_cap for m in self.active]

    def speeds(self) -> list[float] | None:
        """Per active member, its speed; None until every one was measured."""
        speeds = [m.speed for m in self.active]
        return None if any(s is None for s in speeds) else [float(s) for s in speeds if s is not None]

    def nearest(self, node_id: str) -> int:
        """The first rank on node `node_id` (the driver's), else 0. At a round boundary the replicas are equal
        (local SGD's inner optimizer states aside), so the state a checkpoint or the final model reads from it
        crosses no link: 300 MB for a 25M-parameter model with AdamW took 8.7 minutes over 5 Mbit/s from a
        rank 0 on the other machine."""
        return next((r for r, m in enumerate(self.active) if m.info is not None and m.info.node_id == node_id), 0)

    def infos(self) -> list[WorkerInfo]:
        infos = [m.info for m in self.active]
        assert all(i is not None for i in infos), "every active member has reported who it is"
        return [i for i in infos if i is not None]

    def names(self) -> list[str]:
        """Each active worker by rank and device, as a stop names those that produced NaN/Inf steps."""
        return [f"worker {i} ({w.device_name} on {w.host}, {w.device})" for i, w in enumerate(self.infos())]

    # ---- changing ---------------------------------------------------------------------------
    def add(self, member: Member) -> None:
        """A new active member (or one coming back), as the last rank."""
        if member in self._members:
            self._members.remove(member)
        member.status = Status.ACTIVE
        self._members.append(member)

    def set_shares(self, shares: Sequence[int]) -> None:
        assert len(shares) == len(self), (shares, len(self))
        for member, share in zip(self.active, shares):
            member.share = share

    def set_speeds(self, speeds: Sequence[float]) -> None:
        assert len(speeds) == len(self), (speeds, len(self))
        for member, speed in zip(self.active, speeds):
            member.speed = speed

    def park(self, rank: int) -> Member:
        """The member at `rank` leaves the group but keeps its process (see Status.PARKED)."""
        member = self.active[rank]
        member.status = Status.PARKED
        return member

    def take_back(self) -> Member:
        """The member parked last comes back as the last rank."""
        member = self.parked
        assert member is not None, "nobody is parked"
        self.add(member)
        return member

    def leave(self, ranks: Sequence[int], *, lost: bool, keep_spare: bool = False) -> list[Member]:
        """The members at `ranks` are out of the group: `lost` ones leave their bundle vacant for a replacement;
        the others are out for good (spares when `keep_spare`, to be kept with the rest for the next fit)."""
        out = [self.active[r] for r in sorted(set(ranks))]
        for member in out:
            if lost:
                self.vacant.append(member.spec)
            member.status = Status.SPARE if keep_spare and not lost else Status.GONE
        return out

    def release_parked(self, *, keep_spare: bool) -> list[Member]:
        """The parked members leave for good (the job was confirmed faster without them)."""
        out = self.with_status(Status.PARKED)
        for member in out:
            member.status = Status.SPARE if keep_spare else Status.GONE
        return out

    def joining(self, spec: WorkerSpec, worker: Any, building: Any) -> Member:
        """A replacement started in a vacant bundle; it builds in the background."""
        member = Member(worker=worker, spec=spec, status=Status.JOINING, building=building)
        self._members.append(member)
        return member

    def discard(self, member: Member, *, retry: bool) -> None:
        """A replacement that will not join: gone; its bundle stays vacant for another try when `retry`."""
        member.status = Status.GONE
        if not retry and member.spec in self.vacant:
            self.vacant.remove(member.spec)

    def admit(self, member: Member) -> None:
        """A built replacement joins as the last rank; its bundle is no longer vacant."""
        self.vacant.remove(member.spec)
        member.building = None
        self.add(member)

    def forget_gone(self) -> None:
        """Drop the records of stopped members (kept until then for the messages that name them)."""
        self._members = [m for m in self._members if m.status is not Status.GONE]
