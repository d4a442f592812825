"""The worker group as the controller sees it (group/port.py's GroupPort), on Ray: run a round, form the collective
group, leave workers out (by choice or lost), take one back, admit replacements, collect the training state. Each
change of who is in goes through the membership (group/membership.py); each call to a worker is a typed one
(group/worker_calls.py), with its deadline from the run's Tunables."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import ray

from mixtrain.comm import ps_server
from mixtrain.comm.state_transfer import pack, unpack
from mixtrain.config import ScalingConfig, StrategyConfig
from mixtrain.group.admission import Admission
from mixtrain.group.membership import Member, Membership
from mixtrain.group.port import Joined, RoundOutcome, WorkersLost
from mixtrain.group.worker_calls import Pending, WorkerCalls
from mixtrain.group.worker_group import WorkerError, WorkerGroup, WorkerTimeout
from mixtrain.policies.decisions import recovery_source
from mixtrain.records.messages import BuildReport, JoinRequest, RoundPlan
from mixtrain.records.tunables import Tunables
from mixtrain.shard.state import merge_weights
from mixtrain.task import Task


def form_group(group: WorkerGroup, join: Callable[[Any, JoinRequest], Pending[None]], **fields: Any) -> None:
    """Form the collective group of `group`'s members, the one way both doors do (a Task's GroupOps.form, a loop's
    bring-up): rank 0 opens the rendezvous, then every worker joins through `join(worker, request)` with a
    JoinRequest that carries `fields` (strategy, backend, ...)."""
    t = group.tunables
    # every worker on one node (an embedded Ray, a one-machine cluster): the store and the collectives, which
    # have no authentication, listen on loopback only. Asked now: a replacement reports who it is after this
    infos = group.each(lambda w: w.info(), timeout_s=t.rendezvous_timeout_s)
    local = len({info.node_id for info in infos}) == 1
    opened = group.members[0].worker.open_rendezvous(t.rendezvous_timeout_s, local)
    host, port, prefix = group.gather({0: opened}, t.rendezvous_timeout_s)[0]
    request = JoinRequest(
        host=host,
        port=port,
        prefix=prefix,
        rendezvous_timeout_s=t.rendezvous_timeout_s,
        collective_timeout_s=t.collective_timeout_s,
        bucket_bytes=t.bucket_bytes,
        **fields,
    )
    group.each(lambda w: join(w, request), timeout_s=t.rendezvous_timeout_s + t.collective_timeout_s + 10)


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
        self.tunables: Tunables = group.tunables
        self.task_factory = task_factory
        self.strategy = strategy
        self.backend = backend
        self.loss_scaling = loss_scaling
        self.data_refs = data_refs
        self.reference: BuildReport | None = None
        """Rank 0's build report, set once preflight passed."""
        self._fresh_state = True  # the workers hold state the parameter servers have not seen yet
        self.form_s = 0.0
        """Seconds the last formation took (rendezvous and join): the measured price of re-forming the group."""

    @property
    def members(self) -> Membership:
        return self.group.members

    @property
    def scaling(self) -> ScalingConfig:
        return self.group.scaling

    @property
    def shards_optimizer(self) -> bool:
        return self.group.scaling.shard != "none"

    @property
    def slices_weights(self) -> bool:
        """Each worker holds only its slice of the weights (shard="full"): whole weights come from all ranks."""
        return self.group.scaling.shard == "full"

    # ---- the collective group -------------------------------------------------------------------
    def form(self) -> None:
        """Rendezvous at rank 0, join the collective group, set up the strategy (rank 0's weights go to all)."""
        t, start = self.tunables, time.perf_counter()
        form_group(
            self.group,
            lambda w, request: w.join(request),
            strategy=self.strategy,
            backend=self.backend,
            loss_scaling=self.loss_scaling,
            servers=tuple(self.group.servers),
            fresh_state=self._fresh_state,
            shard_optimizer=self._shard_weights(),
            shard_level=self.group.scaling.shard,
            offload=self.group.scaling.offload == "optimizer",
            store_pages_bytes=t.store_pages_bytes,
        )
        self._fresh_state = False
        self.form_s = time.perf_counter() - start

    def _shard_weights(self) -> tuple[float, ...] | None:
        """ScalingConfig.shard_slices for the current ranks: None (not sliced), () (by free memory, measured by the
        workers) or the user's relative sizes, by starting rank."""
        scaling = self.group.scaling
        if scaling.shard == "none":
            return None
        sizes = scaling.shard_slices or scaling.memory_caps()  # the user's sizes, or each group's memory
        if sizes is None:
            return ()
        return tuple(float(sizes[m.spec.rank]) for m in self.members)

    def reform(self) -> None:
        """Everyone leaves and the same workers form the group again (the strategy restarts from the
        state they hold, e.g. after a resume loaded a checkpoint)."""
        self.everyone_leaves()
        self._fresh_state = True
        self.form()

    def everyone_leaves(self) -> None:
        self.group.each(lambda w: w.leave(), timeout_s=self.tunables.collective_timeout_s)

    # ---- a round ----------------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan) -> RoundOutcome:
        """Every worker runs the round; a lost one is reported with what happened, not raised."""
        t = self.tunables
        t0 = time.perf_counter()
        reports, lost = self.group.tolerant(
            lambda w: w.run_round(plan),
            timeout_s=t.round_timeout_s + t.collective_timeout_s,
            grace_s=t.lost_after_s,
            peer_grace_s=t.lost_grace_s,
        )
        return RoundOutcome(reports, lost, time.perf_counter() - t0)

    # ---- state --------------------------------------------------------------------------------------
    def full_state(self) -> dict[str, Any]:
        with self._losses("checkpoint"):
            return unpack(self._full_state())

    def rng_states(self) -> list[dict[str, Any]]:
        with self._losses("checkpoint"):
            return self.group.each(lambda w: w.rng_state(), timeout_s=self.tunables.collective_timeout_s)

    def rank_states(self) -> list[dict[str, Any]]:
        if self.strategy.name != "local-sgd":  # the only strategy whose replicas hold state of their own
            return []
        stall_s = self.tunables.collective_timeout_s
        with self._losses("checkpoint"):  # streamed: a whole optimizer state per rank (see stream_rank_state)
            states = [
                self.group.receive(r, WorkerCalls.stream_rank_state, stall_s=stall_s) for r in range(len(self.members))
            ]
        return [unpack(s) for s in states]

    def evaluate(
        self, bounds: Sequence[tuple[int, int]], batches: Sequence[int], timeout_s: float
    ) -> list[dict[str, float]]:
        with self._losses("evaluate"):
            calls = {r: m.worker.evaluate(*bounds[r], batches[r]) for r, m in enumerate(self.members)}
            return self.group.gather(calls, timeout_s)

    def _full_state(self) -> dict[str, Any]:
        """The training state of the replica nearest the driver (WorkerGroup.nearest: rank 0 where none shares
        its node), packed, streamed to the driver; with a sharded optimizer every other rank's slice of the
        optimizer state is merged in, so the result loads into any number of workers. A worker that sends
        nothing for the collective timeout counts as lost (the whole takes as long as the link needs)."""
        stall_s = self.tunables.collective_timeout_s
        source = self.group.nearest()
        state = self.group.receive(source, WorkerCalls.stream_training_state, stall_s=stall_s)
        if self.group.servers:  # the parameter servers hold the optimizer state: straight from them
            gathered = ps_server.gather_optimizer_state(self.group.servers, self.state_transfer_s())
            state["optimizer"]["state"].update(gathered)
        weights = []  # each rank's own weights (shard="full"; else none)
        if self.shards_optimizer:
            for rank in (r for r in range(len(self.members)) if r != source):
                part = self.group.receive(rank, WorkerCalls.stream_optimizer_part, stall_s=stall_s)
                state["optimizer"]["state"].update(part["optimizer"])
                weights.append(part["model"])
        merge_weights(state["model"], weights)
        return state

    @contextmanager
    def _losses(self, what: str) -> Iterator[None]:
        """A worker lost during a call between rounds becomes WorkersLost (the controller recovers from it)."""
        try:
            yield
        except WorkerTimeout as exc:
            lost = {r: f"did not answer {what}() in time (stopped, asleep or hung)" for r in exc.ranks}
            raise WorkersLost(lost) from exc
        except WorkerError as exc:
            if not isinstance(exc.__cause__, ray.exceptions.RayActorError):
                raise
            grace = self.tunables.lost_after_s
            _, lost = self.group.tolerant(lambda w: w.info(), timeout_s=grace, grace_s=grace, peer_grace_s=grace)
            if not lost:
                raise
            raise WorkersLost(lost) from exc

    def current_state(self) -> Any:
        """Rank 0's current training state as an object ref to hand to a worker: straight from rank 0 through the
        object store (the driver never holds it), or, with a sharded optimizer, with every slice merged in."""
        if self.shards_optimizer:
            return ray.put(self._full_state())
        return self.members[0].worker.training_state().ref

    def state_transfer_s(self) -> float:
        """Deadline for moving one training state (weights and an optimizer of up to twice their size)."""
        weights = self.reference.trainable_bytes if self.reference is not None else 0
        return self.tunables.transfer_s(3 * weights)

    def _copy_state(self, source: int, targets: list[int]) -> None:
        """Rank `source`'s training state into `targets` (outside any group), straight through the object
        store: the driver never holds it."""
        if not targets:
            return
        ref = self.members[source].worker.training_state().ref
        self.group.gather(
            {t: self.members[t].worker.load_training_state(ref) for t in targets}, self.state_transfer_s()
        )

    # ---- who is in ----------------------------------------------------------------------------------
    def leave_out(
        self,
        ranks: Sequence[int],
        *,
        recover: dict[int, int] | None = None,
        lost: bool = False,
        restore: dict[str, Any] | None = None,
        park: bool = False,
    ) -> None:
        """Every other worker leaves the group, `ranks` are stopped, the rest renumbered, and the group
        re-formed. Workers that were `lost` (dead, or stopped and about to be killed) are not asked anything,
        and a replacement may later start in their place; workers left out by choice are not replaced.

        `recover` (after a failed round): each survivor's committed steps by rank. Survivors go back to
        their last committed state, and those behind the most advanced one receive its state before the
        group forms again, so every replica continues from the same step. `restore`: a state every worker loads
        instead, e.g. the last checkpoint when a slice of a sharded optimizer died with its worker. A sharded
        optimizer left whole is re-split among the workers that are left. `park`: the (one) worker left out
        keeps its process, outside the group, so `readmit` can take it back."""
        keep = [r for r in range(len(self.members)) if r not in ranks]
        wait_s = self.state_transfer_s()
        restore_ref = ray.put(pack(restore)) if restore is not None else None
        if restore_ref is None and self.shards_optimizer and not lost:
            restore_ref = ray.put(self._full_state())
        asked = keep + (list(ranks) if park else [])
        if recover is not None and restore_ref is None:
            self.group.each(lambda w: w.recover(), timeout_s=self.tunables.collective_timeout_s, ranks=asked)
        else:
            self.group.each(lambda w: w.leave(), timeout_s=self.tunables.collective_timeout_s, ranks=asked)
        if park:
            [rank] = ranks
            self.group.park(rank)
        else:
            self.group.drop(ranks, lost=lost)
        if restore_ref is not None:
            self.group.each(lambda w: w.load_training_state(restore_ref), timeout_s=wait_s)
        elif recover:
            renumbered = {old: new for new, old in enumerate(keep)}
            source, behind = recovery_source({r: recover[r] for r in keep})
            self._copy_state(renumbered[source], [renumbered[r] for r in behind])
        self.form()

    def readmit(self) -> Member:
        """The worker parked last rejoins as the last rank with rank 0's current state (the group re-forms)."""
        wait_s = self.state_transfer_s()
        parked = self.members.parked
        assert parked is not None, "nobody is parked"
        state_ref = self.current_state()
        self.group.gather({len(self.members): parked.worker.load_training_state(state_ref)}, wait_s)
        self.everyone_leaves()
        member = self.group.take_back()
        if self.shards_optimizer:
            self.group.each(
                lambda w: w.load_training_state(state_ref), timeout_s=wait_s, ranks=range(len(self.members) - 1)
            )
        self.form()
        member.info = self.group.each(lambda w: w.info(), timeout_s=wait_s, ranks=[len(self.members) - 1])[0]
        return member

    def release_parked(self) -> None:
        """The parked workers leave for good (the job is confirmed faster without them)."""
        self.group.release_parked()

    def start_replacements(self) -> None:
        """Start replacements for lost workers now (they build while training goes on; `admit` takes them in
        at a round boundary once built): a process takes seconds to start, longer on a busy machine."""
        self.group.start_replacements(self.task_factory)

    def admit(self, global_batch: int) -> Joined:
        """Replacements that are ready join between rounds (group/admission.py)."""
        return Admission(self).admit(global_batch)
