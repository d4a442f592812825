"""What changes who is in the collective group: form it, leave workers out (by choice or lost), admit
replacements. The bring-up and the controller both hold one `GroupOps`; every call shows in the imports."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from mixtrain import compat
from mixtrain._constants import (
    BUCKET_MB,
    COLLECTIVE_TIMEOUT_S,
    RENDEZVOUS_TIMEOUT_S,
    SETUP_EXTRA_S,
    STORE_PAGES_MB,
    env_float,
    transfer_s,
)
from mixtrain.cluster.placement import WorkerSpec
from mixtrain.comm import ps_server
from mixtrain.config import ScalingConfig, StrategyConfig
from mixtrain.core import preflight
from mixtrain.core.messages import BuildReport, ProbeResult, WorkerInfo
from mixtrain.core.worker_group import WorkerError, WorkerGroup, error_text
from mixtrain.policies.decisions import recovery_source
from mixtrain.task import Task


def setup_wait_s() -> float:
    """How long building, loading and probing a worker may take (it may compile kernels)."""
    return env_float(RENDEZVOUS_TIMEOUT_S) + env_float(SETUP_EXTRA_S)


def user_cap(scaling: ScalingConfig, spec: WorkerSpec) -> int | None:
    """The user's max_micro_batch for this worker (by its starting rank), or None: measure it."""
    return scaling.max_micro_batch[spec.rank] if scaling.max_micro_batch else None


@dataclass
class Joined:
    """Replacements that joined between rounds, and the notes on those refused."""

    workers: list[tuple[WorkerInfo, ProbeResult]]
    refused: list[str]


class GroupOps:
    """Membership changes of one run's worker group, with what they need: the strategy, the backend, the
    job-wide loss scaling, the data in the object store and rank 0's build report (a replacement is
    checked against it)."""

    def __init__(
        self,
        group: WorkerGroup,
        *,
        strategy: StrategyConfig,
        backend: str,
        loss_scaling: bool,
        data_refs: tuple[Any, Any],
        task_factory: Callable[[], Task],
    ) -> None:
        self.group = group
        self.task_factory = task_factory
        self.strategy = strategy
        self.backend = backend
        self.loss_scaling = loss_scaling
        self.data_refs = data_refs
        self.reference: BuildReport | None = None
        """Rank 0's build report, set once preflight passed."""
        self._fresh_state = True  # the workers hold state the parameter servers have not seen yet

    def form(self) -> None:
        """Rendezvous at rank 0, join the collective group, set up the strategy (rank 0's weights go to all)."""
        group = self.group
        rendezvous_s = env_float(RENDEZVOUS_TIMEOUT_S)
        collective_s = env_float(COLLECTIVE_TIMEOUT_S)
        host, port = group.call("open_rendezvous", rendezvous_s, timeout_s=rendezvous_s, ranks=[0])[0]
        bucket_bytes = int(env_float(BUCKET_MB) * 2**20)
        store_pages_bytes = int(env_float(STORE_PAGES_MB, zero_allowed=True) * 2**20)
        group.call(
            "join",
            host,
            port,
            rendezvous_s,
            collective_s,
            self.strategy,
            bucket_bytes,
            self.backend,
            self.loss_scaling,
            tuple(group.servers),
            self._fresh_state,
            self._shard_weights(),
            store_pages_bytes,
            timeout_s=rendezvous_s + collective_s + 10,
        )
        self._fresh_state = False

    def _shard_weights(self) -> tuple[float, ...] | None:
        """ScalingConfig.shard_optimizer for the current ranks: None (off), () (by free memory, measured by the
        workers) or the user's relative sizes, by starting rank."""
        shard = self.group.scaling.shard_optimizer
        if isinstance(shard, bool):
            return () if shard else None
        return tuple(float(shard[spec.rank]) for spec in self.group.specs)

    def reform(self) -> None:
        """Everyone leaves and the same workers form the group again (the strategy restarts from the
        state they hold, e.g. after a resume loaded a checkpoint)."""
        self.group.call("leave", timeout_s=env_float(COLLECTIVE_TIMEOUT_S))
        self._fresh_state = True
        self.form()

    @property
    def shards_optimizer(self) -> bool:
        return self.group.scaling.shard_optimizer is not False

    def full_state(self, stall_s: float) -> dict[str, Any]:
        """Rank 0's training state, packed, streamed to the driver; with a sharded optimizer every rank's slice of
        the optimizer state is merged in, so the result loads into any number of workers. `stall_s`: how long
        a worker may send nothing before it counts as lost (the whole takes as long as the link needs)."""
        state = self.group.receive(0, "training_state", stall_s=stall_s)
        if self.group.servers:  # the parameter servers hold the optimizer state: straight from them
            gathered = ps_server.gather_optimizer_state(self.group.servers, self.state_transfer_s())
            state["optimizer"]["state"].update(gathered)
        if self.shards_optimizer:
            for rank in range(1, self.group.num_workers):
                state["optimizer"]["state"].update(self.group.receive(rank, "optimizer_part", stall_s=stall_s))
        return state

    def leave_out(
        self,
        ranks: list[int],
        *,
        recover: dict[int, int] | None = None,
        lost: bool = False,
        restore: Any = None,
        park: bool = False,
    ) -> None:
        """Every other worker leaves the group, `ranks` are stopped, the rest renumbered, and the group
        re-formed. Workers that were `lost` (dead, or stopped and about to be killed) are not asked anything,
        and a replacement may later start in their place; workers left out by choice are not replaced.

        `recover` (after a failed round): each survivor's committed steps by rank. Survivors go back to
        their last committed state, and those behind the most advanced one receive its state before the
        group forms again, so every replica continues from the same step. `restore`: a state (an object
        ref) every worker loads instead, e.g. the last checkpoint when a slice of a sharded optimizer died
        with its worker. A sharded optimizer left whole is re-split among the workers that are left. `park`:
        the (one) worker left out keeps its process, outside the group, so `readmit` can take it back."""
        keep = [r for r in range(self.group.num_workers) if r not in ranks]
        wait_s = self.state_transfer_s()
        if restore is None and self.shards_optimizer and not lost:
            restore = ray.put(self.full_state(wait_s))
        method = "recover" if recover is not None and restore is None else "leave"
        self.group.call(method, timeout_s=env_float(COLLECTIVE_TIMEOUT_S), ranks=keep + (ranks if park else []))
        if park:
            [rank] = ranks
            self.group.park(rank)
        else:
            self.group.drop(ranks, replaceable=lost)
        if restore is not None:
            self.group.call("load_training_state", restore, None, timeout_s=wait_s)
        elif recover:
            renumbered = {old: new for new, old in enumerate(keep)}
            source, behind = recovery_source({r: recover[r] for r in keep})
            self._copy_state(renumbered[source], [renumbered[r] for r in behind])
        self.form()

    def readmit(self) -> WorkerInfo:
        """The worker parked last rejoins as the last rank with rank 0's current state (the group re-forms)."""
        wait_s = self.state_transfer_s()
        _, actor = self.group.parked[-1]
        if self.shards_optimizer:
            state_ref = ray.put(self.full_state(wait_s))
        else:
            state_ref = self.group.actors[0].training_state.remote()
        ray.get(actor.load_training_state.remote(state_ref, None), timeout=wait_s)
        self.group.call("leave", timeout_s=env_float(COLLECTIVE_TIMEOUT_S))
        self.group.unpark()
        if self.shards_optimizer:
            self.group.call(
                "load_training_state", state_ref, None, timeout_s=wait_s, ranks=range(self.group.num_workers - 1)
            )
        self.form()
        return self.group.call("info", timeout_s=wait_s, ranks=[self.group.num_workers - 1])[0]

    def release_parked(self) -> None:
        """The parked workers leave for good (the job is confirmed faster without them)."""
        self.group.release_parked()

    def start_replacements(self) -> None:
        """Start replacements for lost workers now (they build while training goes on; `admit` takes them in
        at a round boundary once built): a process takes seconds to start, longer on a busy machine."""
        self.group.start_replacements(self.task_factory)

    def state_transfer_s(self) -> float:
        """Deadline for moving one training state (weights and an optimizer of up to twice their size)."""
        weights = self.reference.trainable_bytes if self.reference is not None else 0
        return transfer_s(3 * weights)

    def _copy_state(self, source: int, targets: list[int]) -> None:
        """Rank `source`'s training state into `targets` (outside any group), straight through the object
        store: the driver never holds it."""
        if not targets:
            return
        wait_s = self.state_transfer_s()
        ref = self.group.actors[source].training_state.remote()
        ray.get([self.group.actors[t].load_training_state.remote(ref, None) for t in targets], timeout=wait_s)

    def admit(self, global_batch: int) -> Joined:
        """Between rounds: replacements whose replica is built (a node that came back, a restarted process)
        pass preflight against rank 0, load the data, are measured, receive rank 0's current training state
        and join the re-formed group as the last ranks (a sharded optimizer is re-split over all of them).
        A replacement lost on the way (its process died, its node left, it stopped answering: a laptop on a
        flapping Wi-Fi) is stopped and noted, and the others go on; its bundle may get a new one later."""
        joining, refused = self._vet(self.group.poll_replacements(self.task_factory))
        if not joining:
            return Joined([], refused)
        group, wait_s = self.group, setup_wait_s()
        if self.shards_optimizer:
            state_ref = ray.put(self.full_state(wait_s))
        else:
            state_ref = group.actors[0].training_state.remote()  # straight to the replacements, not via the driver
        n = group.num_workers + len(joining)
        ready: list[tuple[WorkerSpec, Any, ProbeResult]] = []
        for spec, actor, host in joining:
            try:
                ray.get(actor.load_data.remote(*self.data_refs), timeout=wait_s)
                cap = user_cap(group.scaling, spec)
                probe = ray.get(actor.probe.remote(math.ceil(global_batch / n), global_batch, 1.0, cap), timeout=wait_s)
                ray.get(actor.load_training_state.remote(state_ref, None), timeout=wait_s)
            except ray.exceptions.RayError as exc:
                refused.append(self._drop(spec, actor, host, exc))
                continue
            ready.append((spec, actor, probe))
        first = group.num_workers
        if ready:
            try:
                self._take_in(ready, state_ref, wait_s)
            except WorkerError as exc:  # a replacement lost while the group formed with it
                ready, notes = self._without_lost_newcomers(first, ready, exc, state_ref, wait_s)
                refused += notes
        self.start_replacements()  # where one was lost: a new one builds while training goes on
        infos = group.call("info", timeout_s=wait_s, ranks=list(range(first, group.num_workers)))
        return Joined([(info, probe) for info, (_, _, probe) in zip(infos, ready)], refused)

    def _take_in(self, ready: list[tuple[WorkerSpec, Any, ProbeResult]], state_ref: Any, wait_s: float) -> None:
        """The members leave the group, the replacements become the last ranks, and the group forms again."""
        group = self.group
        group.call("leave", timeout_s=env_float(COLLECTIVE_TIMEOUT_S))
        first = group.num_workers
        for spec, actor, _ in ready:
            group.admit(spec, actor)
        if self.shards_optimizer:
            group.call("load_training_state", state_ref, None, timeout_s=wait_s, ranks=range(first))
        self.form()

    def _without_lost_newcomers(
        self,
        first: int,
        ready: list[tuple[WorkerSpec, Any, ProbeResult]],
        error: WorkerError,
        state_ref: Any,
        wait_s: float,
    ) -> tuple[list[tuple[WorkerSpec, Any, ProbeResult]], list[str]]:
        """After `error` while taking replacements in: who is gone (every member's pending call ends first, e.g. a
        rendezvous that waited for the lost one). Replacements (ranks from `first`) that are gone are stopped and
        noted, and the rest form the group again, each replacement (with a sharded optimizer: everyone) loading
        the state it was given again, as the failed formation may have used it up. A member that was there
        before is not this function's to handle: `error` is raised."""
        group = self.group
        wait = env_float(RENDEZVOUS_TIMEOUT_S) + env_float(COLLECTIVE_TIMEOUT_S) + 10
        _, lost = group.call_tolerant("leave", timeout_s=wait, grace_s=wait)
        if not lost or min(lost) < first:
            raise error
        notes = [
            f"a replacement (rank {r}) was dropped while the group formed with it: {why}" for r, why in lost.items()
        ]
        group.drop(sorted(lost), replaceable=True)
        for spec, actor, _ in ready:
            if spec not in group.specs:  # lost, or not taken in yet when it failed: its bundle stays open
                ray.kill(actor)
        ready = [entry for entry in ready if entry[0] in group.specs]
        reload = range(group.num_workers) if self.shards_optimizer else range(first, group.num_workers)
        group.call("load_training_state", state_ref, None, timeout_s=wait_s, ranks=reload)
        self.form()
        return ready, notes

    def _drop(self, spec: WorkerSpec, actor: Any, host: str, exc: Exception) -> str:
        """Stop a replacement that failed while being admitted; returns the note. One that was lost (died, its node
        left, or silent past the deadline) leaves its bundle open for a new replacement; one that raised is
        refused for good (it would again)."""
        text = error_text(exc).strip().splitlines()
        if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)):
            ray.kill(actor)
            why = "it did not answer in time" if isinstance(exc, ray.exceptions.GetTimeoutError) else "it died"
            return f"a replacement on {host} was dropped while being admitted: {why} ({text[0][:160] if text else ''})"
        self.group.discard(spec, actor)
        return (
            f"a replacement on {host} was refused: it failed while being admitted: {text[-1][:300] if text else exc!r}"
        )

    def _vet(
        self, ready: list[tuple[WorkerSpec, Any, BuildReport]]
    ) -> tuple[list[tuple[WorkerSpec, Any, str]], list[str]]:
        """The replacements that pass preflight against rank 0 (with their host), and a note for each one refused."""
        joining, refused = [], []
        for spec, actor, report in ready:
            found = [report.problem] if report.problem else []
            if not found and self.reference is not None:
                found = preflight.problems(compat.versions(), [self.reference, report])
            if found:
                refused.append(f"a replacement on {report.host} was refused: {'; '.join(found)}")
                self.group.discard(spec, actor)
                continue
            joining.append((spec, actor, report.host))
        return joining, refused
