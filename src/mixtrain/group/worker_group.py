"""The Ray side of the workers: one actor per worker, gang-scheduled in a placement group, called SPMD-style through
typed calls (group/worker_calls.py) with one rule for deadlines and errors (group/group_calls.py). Who is in is the
membership's (group/membership.py): this starts, stops and renumbers the processes the membership lists."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mixtrain._files import RunFolder
from mixtrain.cluster import connect, placement
from mixtrain.config import ScalingConfig
from mixtrain.group.group_calls import (
    STREAM_AHEAD,
    GroupCalls,
    WorkerError,
    WorkerTimeout,
    error_text,
    lost_reason,
)
from mixtrain.group.membership import Member, Membership, Status
from mixtrain.group.worker_calls import WorkerCalls
from mixtrain.observe import worker_log
from mixtrain.records.messages import BuildReport, WorkerSetup
from mixtrain.records.tunables import Tunables
from mixtrain.worker import emulation, warm_workers
from mixtrain.worker.replica import TrainWorker

__all__ = [
    "STREAM_AHEAD",
    "WorkerError",
    "WorkerGroup",
    "WorkerTimeout",
    "error_text",
    "lost_reason",
]


def _log_copy(ref: Any) -> tuple[str, str] | None:
    """A worker's (log file name, its end), or None: its log is in the run folder already, or it died (its
    file stays on its machine)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


class WorkerGroup(GroupCalls):
    """The actors of one run. `worker_cls` is a class attribute so tests can inject a failing subclass."""

    worker_cls: type = TrainWorker
    calls_cls: type[WorkerCalls] = WorkerCalls
    """The typed proxy the members' processes are called through (a worker class with more methods has its own)."""

    def __init__(self, scaling: ScalingConfig, seed: int, tunables: Tunables | None = None) -> None:
        self.scaling = scaling
        self.seed = seed
        self.tunables = tunables or Tunables.from_env()
        self.members = Membership()
        self.pg: Any = None
        self.servers: list[Any] = []
        """Parameter-server actors the job started (ps strategies); stopped with the workers."""
        self.log_dir: Path | None = None
        """Where the workers' output goes (RUN_DIR/logs); None leaves it to Ray's log files."""
        self.keep = warm_workers.wanted(scaling.keep_workers)
        """Keep the workers for the next fit when this one ends cleanly (ScalingConfig.keep_workers)."""
        self._started: tuple[list[placement.WorkerSpec], tuple] | None = None
        """(specs, warm-workers key) as started: a set whose every bundle still has its worker may be kept."""
        self._fits = 1
        """The fits these workers served, this one included (more than one: a kept set was reused)."""

    @property
    def actor_cls(self) -> type:
        """The worker class the actors run: worker_cls, slowed where an EMULATION asks for it (worker/emulation.py)."""
        return emulation.slowed(self.worker_cls, self.scaling.slowdown())

    @property
    def num_workers(self) -> int:
        return len(self.members) if self.members.alive else self.scaling.num_workers

    def start(self) -> None:
        """Reserve one bundle per worker (gang-scheduled), then start the actors in them."""
        nodes = placement.nodes_from_ray(ray.nodes())
        self.scaling = placement.resolve_scaling(self.scaling, nodes)  # groups="auto" -> concrete groups
        specs = placement.worker_specs(self.scaling, nodes)
        why = placement.infeasible(specs, nodes)
        if why is not None:
            raise RuntimeError(
                f"the Ray cluster cannot hold these workers: {why}. Cluster: {placement.describe(nodes)}. "
                "Use fewer workers or smaller resources_per_worker / cpus_per_worker (fractions such as 0.5 are "
                "allowed), or add a node with `mixtrain cluster join`."
            )
        key = warm_workers.key_for(
            self.actor_cls, specs, self.scaling.placement_strategy, self.scaling.network_interface
        )
        self._started = (list(specs), key)
        idle = warm_workers.take(key)  # frees a kept set started for other workers, so this one has room
        if idle is not None and self._reuse(idle, specs):
            return
        self._reserve(specs)
        self.members = Membership([Member(worker=self._start_actor(s, s.rank, len(specs)), spec=s) for s in specs])

    def _reserve(self, specs: list[placement.WorkerSpec]) -> None:
        timeout = self.tunables.placement_timeout_s
        selectors = [s.label_selector for s in specs]
        self.pg = placement_group(
            [s.bundle for s in specs],
            strategy=self.scaling.placement_strategy,
            bundle_label_selector=selectors if any(selectors) else None,
        )
        if not self.pg.wait(timeout_seconds=timeout):
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"Ray could not reserve {len(specs)} workers ({self.scaling.placement_strategy}) within "
                f"{timeout:g} s (MIXTRAIN_PLACEMENT_TIMEOUT_S). Cluster: {connect.inventory()}. Free resources "
                "held by other jobs, use fewer workers, or relax the placement strategy."
            )

    def _reuse(self, idle: warm_workers.Idle, specs: list[placement.WorkerSpec]) -> bool:
        """Take a kept set of workers: each resets itself for this run. False (and the set freed) when one
        does not answer: new workers start instead."""
        self.pg, self._fits = idle.pg, idle.fits + 1
        self.members = Membership([Member(worker=self.calls_cls(a), spec=s) for a, s in zip(idle.actors, specs)])
        try:
            self.gather(
                {m.spec.rank: m.worker.reuse(self._setup(m.spec, m.spec.rank, len(specs))) for m in self.members},
                self.tunables.renumber_timeout_s,
            )
        except (WorkerError, ray.exceptions.RayError):  # a dead worker, or handles of a Ray that is gone
            warm_workers.free(idle)
            self.pg, self.members = None, Membership()
            return False
        return True

    def _start_actor(self, spec: placement.WorkerSpec, rank: int, world_size: int) -> WorkerCalls:
        """A worker actor in its own bundle of the placement group (the bundle index is its starting rank)."""
        env = {}
        if self.scaling.network_interface:
            env = {
                "GLOO_SOCKET_IFNAME": self.scaling.network_interface,
                "NCCL_SOCKET_IFNAME": self.scaling.network_interface,
            }
        remote = _actor_class(self.actor_cls)
        actor = remote.options(
            num_cpus=spec.bundle.get("CPU", 0.0),
            num_gpus=spec.bundle.get("GPU", 0.0),
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=spec.rank),
        ).remote(self._setup(spec, rank, world_size))
        return self.calls_cls(actor)

    def _setup(self, spec: placement.WorkerSpec, rank: int, world_size: int) -> WorkerSetup:
        caps = self.scaling.memory_caps()  # per starting rank: the bundle's
        return WorkerSetup(
            rank=rank,
            world_size=world_size,
            num_threads=spec.threads,
            seed=self.seed,
            device_request=spec.device,
            precision_request=spec.precision,
            log_to=self._log_to(),
            bundle=spec.rank,
            memory_cap=caps[spec.rank] if caps else None,
        )

    def _log_to(self) -> tuple[str, str] | None:
        if self.log_dir is None:
            return None
        with RunFolder(self.log_dir.parent) as run:  # RUN_DIR/logs, 0700, never through a link planted there
            run.folder(self.log_dir.name)
        # absolute: a worker's working folder is its Ray node's, not the driver's (a cluster started elsewhere)
        return str(self.log_dir.absolute()), ray.get_runtime_context().get_node_id()

    # ---- who is in --------------------------------------------------------------------------------
    def drop(self, ranks: Iterable[int], *, lost: bool = False) -> None:
        """Stop the workers at (current) `ranks`, outside any process group; the rest are renumbered. `lost`: a
        replacement may start in their bundles. Healthy ones left out while `keep` stay as spares (their memory
        freed now), to be kept for the next fit with the others."""
        spare = self.keep and not lost
        for member in self.members.leave(list(ranks), lost=lost, keep_spare=spare):
            self._stop(member, spare)
        self.renumber()

    def park(self, rank: int) -> Member:
        """Take the worker at `rank` out of the numbering (it has left the group) but keep its process."""
        member = self.members.park(rank)
        self.renumber()
        return member

    def release_parked(self) -> None:
        """The parked workers leave for good (the job is confirmed faster without them)."""
        for member in self.members.release_parked(keep_spare=self.keep):
            self._stop(member, self.keep)

    def take_back(self) -> Member:
        """The parked worker comes back as the last rank (outside any group; form it next)."""
        member = self.members.take_back()
        self.renumber()
        return member

    def _stop(self, member: Member, spare: bool) -> None:
        if spare:
            member.worker.shutdown()
        else:
            ray.kill(member.worker.actor)

    def renumber(self) -> None:
        """Tell every active worker its rank (its place in the membership) and the new world size."""
        n = len(self.members)
        self.gather({r: m.worker.set_rank(r, n) for r, m in enumerate(self.members)}, self.tunables.renumber_timeout_s)

    def start_replacements(self, task_factory: Any) -> None:
        """Start a replacement actor in every vacant bundle that has none yet; it builds its replica in the
        background. Never blocks: a bundle on a node that is gone waits until Ray can place it again."""
        busy = {m.spec.rank for m in self.members.with_status(Status.JOINING)}
        for spec in self.members.vacant:
            if spec.rank not in busy:
                worker = self._start_actor(spec, -1, 0)
                self.members.joining(spec, worker, worker.build(task_factory))

    def poll_replacements(self, task_factory: Any) -> list[tuple[Member, BuildReport]]:
        """Start replacements where none runs yet, and return those whose replica is built."""
        self.start_replacements(task_factory)
        ready = []
        for member in self.members.with_status(Status.JOINING):
            if not ray.wait([member.building.ref], timeout=0)[0]:
                continue
            try:
                report = ray.get(member.building.ref)
            except ray.exceptions.RayError:
                ray.kill(member.worker.actor)  # tried again at the next round boundary
                self.members.discard(member, retry=True)
                continue
            ready.append((member, report))
        return ready

    def discard(self, member: Member, *, retry: bool = False) -> None:
        """A replacement that cannot join: stop it. Its bundle gets another replacement later when `retry` (it died
        while joining: its node may come back), never when not (its node fails preflight)."""
        ray.kill(member.worker.actor)
        self.members.discard(member, retry=retry)

    def shutdown(self, quick: bool = False, finished: bool = False) -> None:
        """Leave the process group where possible, copy the logs of workers on other machines into the run
        folder, then kill the actors and free the resources. `quick` (Ctrl-C): kill at once. `finished` (the
        run ended cleanly) with `keep`: if every bundle still has a worker that answers, they are kept for the
        next fit (warm_workers) instead, left-out and parked ones included."""
        if not quick:
            self._fetch_remote_logs()
        for member in self.members.with_status(Status.JOINING):
            ray.kill(member.worker.actor)
        members = [m for m in self.members.alive if m.status is not Status.JOINING]
        self.members = Membership()
        if members and not quick:
            refs = [m.worker.shutdown().ref for m in members]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.tunables.shutdown_wait_s)
            if finished and self.keep and self._keep(members, ready, refs):
                members = []  # kept, with their bundles: this group holds neither any more
        for member in members:
            ray.kill(member.worker.actor)
        for server in self.servers:
            ray.kill(server)
        self.servers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _fetch_remote_logs(self) -> None:
        if self.log_dir is None or not self.members.active:
            return
        refs = [m.worker.log_text().ref for m in self.members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.tunables.shutdown_wait_s)
        copies = [got for got in map(_log_copy, ready) if got is not None]
        if copies:
            worker_log.save_copies(self.log_dir, copies)

    def _keep(self, members: list[Member], ready: list[Any], refs: list[Any]) -> bool:
        """Hand the workers and their bundles to warm_workers, in the order they started, if every bundle still
        has its first worker's spec and each left its group (a lost worker that was not replaced: not kept)."""
        if self._started is None or len(ready) != len(refs) or self._fits >= self.tunables.keep_workers_max_fits:
            return False
        started, key = self._started
        by_bundle = {m.spec.rank: m for m in members}
        if sorted(by_bundle) != [s.rank for s in started] or [by_bundle[s.rank].spec for s in started] != started:
            return False
        try:
            ray.get(ready)
        except ray.exceptions.RayError:
            return False
        actors = [by_bundle[s.rank].worker.actor for s in started]
        warm_workers.keep(warm_workers.Idle(key, self.pg, actors, self._fits))
        self.pg = None
        return True


@functools.cache
def _actor_class(cls: type) -> Any:
    """Ray's actor class for `cls`, made once per process: each `ray.remote(cls)` is a new one that Ray exports
    again at its first `.remote()` (pickles it, hashes its disassembled code: 28 ms for TrainWorker, 2026-12-06),
    once per worker started. Ray exports it again itself for a new cluster or job."""
    return ray.remote(cls)
