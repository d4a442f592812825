"""One Ray actor per worker, gang-scheduled in a placement group, called SPMD-style."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mixtrain._constants import (
    KEEP_WORKERS_MAX_FITS,
    PLACEMENT_TIMEOUT_S,
    RENUMBER_TIMEOUT_S,
    SHUTDOWN_WAIT_S,
    env_float,
)
from mixtrain.cluster import connect, placement
from mixtrain.comm import state_transfer
from mixtrain.config import ScalingConfig
from mixtrain.core import warm_workers
from mixtrain.core.messages import WorkerSetup
from mixtrain.core.worker import TrainWorker
from mixtrain.observe import worker_log


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank and node and carries its traceback."""


class WorkerTimeout(WorkerError):
    """Workers did not answer in time (stopped, asleep, hung, or on a link slower than the deadline allows)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
STREAM_AHEAD = 128
"""A streamed state's pieces a worker sends ahead of what the driver has read (128 x 64 KB: 8 MB). Unbounded, a
worker runs through the whole state at once and the pieces the driver has not read yet pile up in both processes:
rank 0's peak was 20-100 MB higher and the driver's 60-200 MB on a 12.6M-parameter AdamW state. It costs little:
150 MB took 0.6-0.7 s instead of 0.3-0.6 s on one machine."""


def open_stream(actor: Any, *args: Any) -> Any:
    """actor.stream(*args) as Ray's streaming generator, at most STREAM_AHEAD pieces ahead of the reader."""
    return actor.stream.options(num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD).remote(*args)


def error_text(exc: BaseException) -> str:
    """What a Ray error says, without the terminal colours Ray puts in."""
    return _ANSI.sub("", str(exc))


def _describe(rank: int, method: str, exc: Exception) -> str:
    text = error_text(exc)
    message = f"worker {rank} failed in {method}():\n{text}"
    if "ModuleNotFoundError" in text or "No module named" in text:
        message += (
            "\nFix: the task factory (and what it imports) must be importable on every worker: define it in an "
            "installed package, or in a module under the folder you start from (local workers share your working "
            "directory), or set PYTHONPATH for the Ray nodes."
        )
    return message


def _log_copy(ref: Any) -> tuple[str, str] | None:
    """A worker's (log file name, its end), or None: its log is in the run folder already, or it died (its
    file stays on its machine)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


class WorkerGroup:
    """The actors of one run. `worker_cls` is a class attribute so tests can inject a failing subclass."""

    worker_cls: type = TrainWorker

    def __init__(self, scaling: ScalingConfig, seed: int) -> None:
        self.scaling = scaling
        self.seed = seed
        self.actors: list[Any] = []
        self.specs: list[placement.WorkerSpec] = []
        self.pg: Any = None
        self.vacant: list[placement.WorkerSpec] = []
        """Bundles of lost workers, where a replacement may start (a node that comes back, a restarted process)."""
        self._pending: dict[int, tuple[placement.WorkerSpec, Any, Any]] = {}  # bundle -> (spec, actor, build ref)
        self.servers: list[Any] = []
        """Parameter-server actors the job started (ps strategies); stopped with the workers."""
        self.parked: list[tuple[placement.WorkerSpec, Any]] = []
        """Workers left out mid-run but kept alive (outside the group), to take back if the job was faster with them."""
        self.log_dir: Path | None = None
        """Where the workers' output goes (RUN_DIR/logs); None leaves it to Ray's log files."""
        self.keep = warm_workers.wanted(scaling.keep_workers)
        """Keep the workers for the next fit when this one ends cleanly (ScalingConfig.keep_workers)."""
        self.spare: list[tuple[placement.WorkerSpec, Any]] = []
        """Workers left out (not lost) while `keep`: idle until the run ends, then kept with the others."""
        self._started: tuple[list[placement.WorkerSpec], tuple] | None = None
        """(specs, warm-workers key) as started: a set whose every bundle still has its worker may be kept."""
        self._fits = 1
        """The fits these workers served, this one included (more than one: a kept set was reused)."""

    @property
    def num_workers(self) -> int:
        return len(self.actors) if self.actors else self.scaling.num_workers

    def start(self) -> None:
        """Reserve one bundle per worker (gang-scheduled), then start the actors in them."""
        nodes = placement.nodes_from_ray(ray.nodes())
        self.scaling = placement.resolve_scaling(self.scaling, nodes)  # groups="auto" -> concrete groups
        self.specs = placement.worker_specs(self.scaling, nodes)
        why = placement.infeasible(self.specs, nodes)
        if why is not None:
            raise RuntimeError(
                f"the Ray cluster cannot hold these workers: {why}. Cluster: {placement.describe(nodes)}. "
                "Use fewer workers or smaller resources_per_worker / cpus_per_worker (fractions such as 0.5 are "
                "allowed), or add a node with `mixtrain cluster join`."
            )
        key = warm_workers.key_for(
            self.worker_cls, self.specs, self.scaling.placement_strategy, self.scaling.network_interface
        )
        self._started = (list(self.specs), key)
        idle = warm_workers.take(key)  # frees a kept set started for other workers, so this one has room
        if idle is not None and self._reuse(idle):
            return
        timeout = env_float(PLACEMENT_TIMEOUT_S)
        selectors = [s.label_selector for s in self.specs]
        self.pg = placement_group(
            [s.bundle for s in self.specs],
            strategy=self.scaling.placement_strategy,
            bundle_label_selector=selectors if any(selectors) else None,
        )
        if not self.pg.wait(timeout_seconds=timeout):
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"Ray could not reserve {len(self.specs)} workers ({self.scaling.placement_strategy}) within "
                f"{timeout:g} s (MIXTRAIN_PLACEMENT_TIMEOUT_S). Cluster: {connect.inventory()}. Free resources "
                "held by other jobs, use fewer workers, or relax the placement strategy."
            )
        n = len(self.specs)
        self.actors = [self._make_actor(spec, spec.rank, n) for spec in self.specs]

    def _reuse(self, idle: warm_workers.Idle) -> bool:
        """Take a kept set of workers: each resets itself for this run. False (and the set freed) when one
        does not answer: new workers start instead."""
        self.pg, self.actors, self._fits = idle.pg, idle.actors, idle.fits + 1
        setups = [(self._setup(spec, spec.rank, len(self.specs)),) for spec in self.specs]
        try:
            self.call_each("reuse", setups, timeout_s=env_float(RENUMBER_TIMEOUT_S))
        except (WorkerError, ray.exceptions.RayError):  # a dead worker, or handles of a Ray that is gone
            warm_workers.free(idle)
            self.pg, self.actors = None, []
            return False
        return True

    def _fetch_remote_logs(self) -> None:
        if self.log_dir is None or not self.actors:
            return
        refs = [a.log_text.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=env_float(SHUTDOWN_WAIT_S))
        copies = [got for got in map(_log_copy, ready) if got is not None]
        if copies:
            worker_log.save_copies(self.log_dir, copies)

    def _make_actor(self, spec: placement.WorkerSpec, rank: int, world_size: int) -> Any:
        """A worker actor in its own bundle of the placement group (the bundle index is its starting rank)."""
        env = {}
        if self.scaling.network_interface:
            env = {
                "GLOO_SOCKET_IFNAME": self.scaling.network_interface,
                "NCCL_SOCKET_IFNAME": self.scaling.network_interface,
            }
        remote: Any = ray.remote(self.worker_cls)
        return remote.options(
            num_cpus=spec.bundle.get("CPU", 0.0),
            num_gpus=spec.bundle.get("GPU", 0.0),
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=spec.rank),
        ).remote(self._setup(spec, rank, world_size))

    def _setup(self, spec: placement.WorkerSpec, rank: int, world_size: int) -> WorkerSetup:
        return WorkerSetup(
            rank=rank,
            world_size=world_size,
            num_threads=spec.threads,
            seed=self.seed,
            device_request=spec.device,
            precision_request=spec.precision,
            log_to=self._log_to(),
        )

    def _log_to(self) -> tuple[str, str] | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return str(self.log_dir), ray.get_runtime_context().get_node_id()

    def drop(self, ranks: Sequence[int], replaceable: bool = False) -> None:
        """Stop the workers at (current) `ranks`, outside any process group; the rest are renumbered
        0..n-1. `specs` keep their starting ranks, which is how the user's per-worker settings are found.
        `replaceable`: they were lost, not left out, so a replacement may start in their bundles."""
        gone = set(ranks)
        if replaceable:
            self.vacant += [s for r, s in enumerate(self.specs) if r in gone]
        for r in gone:
            if self.keep and not replaceable:  # healthy, only left out: kept for the next fit with the others,
                self.spare.append((self.specs[r], self.actors[r]))  # out of the group and its memory freed now
                self.actors[r].shutdown.remote()
            else:
                ray.kill(self.actors[r])
        self.actors = [a for r, a in enumerate(self.actors) if r not in gone]
        self.specs = [s for r, s in enumerate(self.specs) if r not in gone]
        self._renumber()

    def park(self, rank: int) -> None:
        """Take the worker at `rank` out of the numbering (it has left the group) but keep its process."""
        self.parked.append((self.specs.pop(rank), self.actors.pop(rank)))
        self._renumber()

    def release_parked(self) -> None:
        """The parked workers leave for good (the job is confirmed faster without them): stopped, or with `keep`
        moved to the spares, their memory freed now, to be kept for the next fit with the others."""
        for spec, actor in self.parked:
            if self.keep:
                self.spare.append((spec, actor))
                actor.shutdown.remote()
            else:
                ray.kill(actor)
        self.parked = []

    def unpark(self) -> None:
        """The last parked worker comes back as the last rank (outside any group; form it next)."""
        spec, actor = self.parked.pop()
        self.specs.append(spec)
        self.actors.append(actor)
        self._renumber()

    def _renumber(self) -> None:
        """Tell every actor its rank (its place in `actors`) and the new world size."""
        self.call_each(
            "set_rank",
            [(i, len(self.actors)) for i in range(len(self.actors))],
            timeout_s=env_float(RENUMBER_TIMEOUT_S),
        )

    def call(self, method: str, *args: Any, timeout_s: float, ranks: Sequence[int] | None = None) -> list[Any]:
        """Call `method(*args)` on the given ranks (all by default) and return results in rank order."""
        ranks = list(range(self.num_workers)) if ranks is None else list(ranks)
        return self._gather(method, {r: getattr(self.actors[r], method).remote(*args) for r in ranks}, timeout_s)

    def receive(self, rank: int, what: str, *, stall_s: float) -> Any:
        """`what` (a TrainWorker.stream name) from worker `rank`, streamed in small pieces: no deadline for the
        whole (a large model on a slow link takes as long as it takes), but a peer silent for `stall_s` between
        two pieces is WorkerTimeout, and a dead one WorkerError."""
        gen = open_stream(self.actors[rank], what)

        def pieces() -> Iterator[Any]:
            while True:
                ready, _ = ray.wait([gen], timeout=stall_s)
                if not ready:
                    raise WorkerTimeout(f"worker {rank} sent nothing of {what} for {stall_s:g} s", [rank])
                try:
                    yield ray.get(next(gen))
                except StopIteration:
                    return
                except ray.exceptions.RayError as exc:
                    raise WorkerError(_describe(rank, f"stream({what!r})", exc)) from exc

        return state_transfer.receive(pieces())

    def call_each(self, method: str, args_per_rank: Sequence[tuple], *, timeout_s: float) -> list[Any]:
        """Call `method` on every rank with that rank's arguments."""
        refs = {r: getattr(a, method).remote(*args) for r, (a, args) in enumerate(zip(self.actors, args_per_rank))}
        return self._gather(method, refs, timeout_s)

    def _gather(self, method: str, refs: dict[int, Any], timeout_s: float) -> list[Any]:
        """Wait for all results, but raise at the FIRST failure rather than after the slowest rank."""
        rank_of = {ref: r for r, ref in refs.items()}
        results: dict[int, Any] = {}
        pending = list(refs.values())
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
            if not ready:
                missing = sorted(rank_of[p] for p in pending)
                raise WorkerTimeout(
                    f"worker(s) {missing} did not finish {method}() within {timeout_s:g} s; see the timeouts "
                    "MIXTRAIN_*_TIMEOUT_S in the README",
                    missing,
                )
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise WorkerError(_describe(rank_of[ref], method, exc)) from exc
        return [results[r] for r in sorted(results)]

    def call_tolerant(
        self, method: str, *args: Any, timeout_s: float, grace_s: float, peer_grace_s: float | None = None
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """Call `method(*args)` on every rank, surviving lost workers: returns (results by rank, the lost
        ranks with what happened). A worker is lost when its process died or, once another worker has
        died, it has not answered within `grace_s` (stopped, asleep or hung); once another worker reported
        a silent peer (its collective timed out: the silent one had that long already), within `peer_grace_s`.
        Any other error in a worker is raised as WorkerError: that is a bug or a device error, not a loss."""
        peer_grace_s = grace_s if peer_grace_s is None else peer_grace_s
        refs = {getattr(a, method).remote(*args): r for r, a in enumerate(self.actors)}
        results: dict[int, Any] = {}
        lost: dict[int, str] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        waited = timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            rank = refs[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the process died or its node is gone
                lost[rank] = f"its process died or its node left ({_ANSI.sub('', str(exc)).splitlines()[0][:160]})"
            except ray.exceptions.RayError as exc:
                raise WorkerError(_describe(rank, method, exc)) from exc
            if lost:
                deadline = min(deadline, time.monotonic() + grace_s)
                waited = grace_s
            elif rank in results and bool(getattr(results[rank], "peer_lost", "")):
                # a timed-out collective: a silent peer had the whole timeout already. A closed connection
                # (a peer that died, or left on purpose after running out of memory) says nothing about
                # the rest, which may still be computing on a loaded machine: the usual grace
                wait = peer_grace_s if getattr(results[rank], "peer_silent", False) else grace_s
                deadline = min(deadline, time.monotonic() + wait)
                waited = min(waited, wait)
        for ref in pending:
            lost[refs[ref]] = (
                f"did not answer within {waited:g} s after a peer failed (stopped, asleep or hung; "
                "MIXTRAIN_COLLECTIVE_TIMEOUT_S, MIXTRAIN_LOST_GRACE_S)"
            )
        return results, lost

    def start_replacements(self, task_factory: Any) -> None:
        """Start a replacement actor in every vacant bundle that has none yet; it builds its replica in the
        background. Never blocks: a bundle on a node that is gone waits until Ray can place it again."""
        for spec in self.vacant:
            if spec.rank not in self._pending:
                actor = self._make_actor(spec, -1, 0)
                self._pending[spec.rank] = (spec, actor, actor.build.remote(task_factory))

    def poll_replacements(self, task_factory: Any) -> list[tuple[placement.WorkerSpec, Any, Any]]:
        """Start replacements where none runs yet, and return those whose replica is built."""
        self.start_replacements(task_factory)
        ready = []
        for bundle, (spec, actor, ref) in list(self._pending.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del self._pending[bundle]
            try:
                report = ray.get(ref)
            except ray.exceptions.RayError:
                ray.kill(actor)  # tried again at the next round boundary
                continue
            ready.append((spec, actor, report))
        return ready

    def admit(self, spec: placement.WorkerSpec, actor: Any) -> None:
        """Add a built replacement as the last rank (outside any process group; form it next)."""
        self.vacant.remove(spec)
        self.actors.append(actor)
        self.specs.append(spec)
        self._renumber()

    def discard(self, spec: placement.WorkerSpec, actor: Any) -> None:
        """A replacement that cannot join (its node fails preflight): stop it and stop trying that bundle."""
        ray.kill(actor)
        self.vacant.remove(spec)

    def shutdown(self, quick: bool = False, finished: bool = False) -> None:
        """Leave the process group where possible, copy the logs of workers on other machines into the run
        folder, then kill the actors and free the resources. `quick` (Ctrl-C): kill at once. `finished` (the
        run ended cleanly) with `keep`: if every bundle still has a worker that answers, they are kept for the
        next fit (warm_workers) instead, left-out and parked ones included."""
        if not quick:
            self._fetch_remote_logs()
        for _, actor, _ in self._pending.values():
            ray.kill(actor)
        self._pending = {}
        members = [*zip(self.specs, self.actors), *self.parked, *self.spare]
        self.actors, self.parked, self.spare = [], [], []
        if members and not quick:
            refs = [actor.shutdown.remote() for _, actor in members]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=env_float(SHUTDOWN_WAIT_S))
            if finished and self.keep and self._keep(members, ready, refs):
                members = []  # kept, with their bundles: this group holds neither any more
        for _, actor in members:
            ray.kill(actor)
        for server in self.servers:
            ray.kill(server)
        self.servers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _keep(self, members: list[tuple[placement.WorkerSpec, Any]], ready: list[Any], refs: list[Any]) -> bool:
        """Hand the workers and their bundles to warm_workers, in the order they started, if every bundle still
        has its first worker's spec and each left its group (a lost worker that was not replaced: not kept)."""
        if self._started is None or len(ready) != len(refs) or self._fits >= env_float(KEEP_WORKERS_MAX_FITS):
            return False
        started, key = self._started
        by_bundle = dict((spec.rank, (spec, actor)) for spec, actor in members)
        if sorted(by_bundle) != [s.rank for s in started] or [by_bundle[s.rank][0] for s in started] != started:
            return False
        try:
            ray.get(ready)
        except ray.exceptions.RayError:
            return False
        warm_workers.keep(warm_workers.Idle(key, self.pg, [by_bundle[s.rank][1] for s in started], self._fits))
        self.pg = None
        return True
