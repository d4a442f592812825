"""Taking replacements in between rounds: a replacement whose replica is built (a node that came back, a restarted
process) passes preflight against rank 0, loads the data, is measured, receives rank 0's current training state and
joins the re-formed group as the last rank. One lost on the way (its process died, its node left, it stopped
answering: a laptop on a flapping Wi-Fi) is stopped and noted, the others go on, and a new one starts in its
bundle; one that fails preflight or raises is refused for good."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import ray

from mixtrain import compat
from mixtrain.group import preflight
from mixtrain.group.membership import Member, Membership, Status, user_cap
from mixtrain.group.port import Joined
from mixtrain.group.worker_group import WorkerError, WorkerGroup, WorkerTimeout, error_text
from mixtrain.records.messages import BuildReport
from mixtrain.records.tunables import Tunables
from mixtrain.task import Task


class Operations(Protocol):
    """What an admission needs of the group's operations (group/group_ops.py GroupOps, which calls it): named here,
    so this module does not import the one that imports it."""

    group: WorkerGroup
    tunables: Tunables
    reference: BuildReport | None
    data_refs: tuple[Any, Any]
    task_factory: Callable[[], Task]

    @property
    def members(self) -> Membership: ...

    @property
    def shards_optimizer(self) -> bool: ...

    def current_state(self) -> Any: ...

    def everyone_leaves(self) -> None: ...

    def form(self) -> None: ...

    def start_replacements(self) -> None: ...

    def state_transfer_s(self) -> float: ...


class Admission:
    """One admission, for the group `ops` runs."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.group = ops.group
        self.members = ops.members

    def admit(self, global_batch: int) -> Joined:
        """Between rounds: replacements whose replica is built (a node that came back, a restarted process)
        pass preflight against rank 0, load the data, are measured, receive rank 0's current training state
        and join the re-formed group as the last ranks (a sharded optimizer is re-split over all of them).
        A replacement lost on the way (its process died, its node left, it stopped answering: a laptop on a
        flapping Wi-Fi) is stopped and noted, the others go on, and a new one starts in its bundle."""
        joining, refused = self._vet(self.group.poll_replacements(self.ops.task_factory))
        if not joining:
            return Joined([], refused)
        state_ref = self.ops.current_state()
        n = len(self.members) + len(joining)
        ready = [m for m in joining if self._prepare(m, global_batch, n, state_ref, refused)]
        first = len(self.members)
        if ready:
            try:
                self._take_in(ready, state_ref)
            except WorkerError as exc:  # a replacement lost while the group formed with it
                ready, notes = self._without_lost_newcomers(first, ready, exc, state_ref)
                refused += notes
        self.ops.start_replacements()  # where one was lost: a new one builds while training goes on
        infos = self.group.each(
            lambda w: w.info(), timeout_s=self.ops.tunables.setup_s, ranks=range(first, len(self.members))
        )
        for member, info in zip(ready, infos):
            member.info = info
        return Joined(ready, refused)

    def _take_in(self, ready: list[Member], state_ref: Any) -> None:
        """The members leave the group, the replacements become the last ranks, and the group forms again."""
        self.ops.everyone_leaves()
        first = len(self.members)
        for member in ready:
            self.members.admit(member)
        self.group.renumber()
        if self.ops.shards_optimizer:
            self.group.each(
                lambda w: w.load_training_state(state_ref), timeout_s=self.ops.state_transfer_s(), ranks=range(first)
            )
        self.ops.form()

    def _without_lost_newcomers(
        self, first: int, ready: list[Member], error: WorkerError, state_ref: Any
    ) -> tuple[list[Member], list[str]]:
        """After `error` while taking replacements in: who is gone (every member's pending call ends first, e.g. a
        rendezvous that waited for the lost one). Replacements (ranks from `first`) that are gone are stopped and
        noted, and the rest form the group again, each replacement (with a sharded optimizer: everyone) loading
        the state it was given again, as the failed formation may have used it up. A member that was there
        before is not this function's to handle: `error` is raised."""
        t = self.ops.tunables
        wait = t.rendezvous_timeout_s + t.collective_timeout_s + 10
        _, lost = self.group.tolerant(lambda w: w.leave(), timeout_s=wait, grace_s=wait, peer_grace_s=wait)
        if not lost or min(lost) < first:
            raise error
        notes = [
            f"a replacement (rank {r}) was dropped while the group formed with it: {why}" for r, why in lost.items()
        ]
        self.group.drop(sorted(lost), lost=True)
        ready = [m for m in ready if m.status is Status.ACTIVE]
        reload = range(len(self.members)) if self.ops.shards_optimizer else range(first, len(self.members))
        self.group.each(lambda w: w.load_training_state(state_ref), timeout_s=self.ops.state_transfer_s(), ranks=reload)
        self.ops.form()
        return ready, notes

    def _prepare(self, member: Member, global_batch: int, n: int, state_ref: Any, refused: list[str]) -> bool:
        """A replacement loads the data, is measured and receives the current state; False (and it is stopped,
        with a note in `refused`) when it fails meanwhile."""
        wait_s, worker = self.ops.tunables.setup_s, member.worker
        cap = user_cap(self.group.scaling, member.spec)
        forward_only = self.group.scaling.shard in ("gradients", "full")  # the whole gradient may not fit here
        try:
            self.group.gather({n - 1: worker.load_data(*self.ops.data_refs)}, wait_s)
            member.probe = self.group.gather(
                {n - 1: worker.probe(math.ceil(global_batch / n), global_batch, cap, forward_only)}, wait_s
            )[0]
            self.group.gather({n - 1: worker.load_training_state(state_ref)}, wait_s)
        except WorkerError as exc:
            refused.append(self._drop(member, exc))
            return False
        member.speed, member.memory_cap = member.probe.samples_per_s, member.probe.memory_cap
        return True

    def _drop(self, member: Member, exc: WorkerError) -> str:
        """Stop a replacement that failed while being admitted; returns the note. One that was lost (died, its node
        left, or silent past the deadline) leaves its bundle open for a new replacement; one that raised is
        refused for good (it would again)."""
        host = member.report.host if member.report is not None else "?"
        lost = isinstance(exc, WorkerTimeout) or isinstance(exc.__cause__, ray.exceptions.RayActorError)
        self.group.discard(member, retry=lost)
        text = error_text(exc).strip().splitlines()
        if lost:
            why = "it did not answer in time" if isinstance(exc, WorkerTimeout) else "it died"
            return f"a replacement on {host} was dropped while being admitted: {why} ({text[-1][:160] if text else ''})"
        return (
            f"a replacement on {host} was refused: it failed while being admitted: {text[-1][:300] if text else exc!r}"
        )

    def _vet(self, ready: list[tuple[Member, BuildReport]]) -> tuple[list[Member], list[str]]:
        """The replacements that pass preflight against rank 0, and a note for each one refused."""
        joining, refused = [], []
        for member, report in ready:
            member.report = report
            found = [report.problem] if report.problem else []
            if not found and self.ops.reference is not None:
                found = preflight.problems(compat.versions(), [self.ops.reference, report])
            if found:
                refused.append(f"a replacement on {report.host} was refused: {'; '.join(found)}")
                self.group.discard(member)
                continue
            joining.append(member)
        return joining, refused
