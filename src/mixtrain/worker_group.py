"""One Ray actor per worker, gang-scheduled in a placement group, called SPMD-style."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mixtrain import cluster
from mixtrain._constants import PLACEMENT_TIMEOUT_S, env_float
from mixtrain.config import ScalingConfig
from mixtrain.worker import TrainWorker


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank and node and carries its traceback."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _describe(rank: int, method: str, exc: Exception) -> str:
    text = _ANSI.sub("", str(exc))
    message = f"worker {rank} failed in {method}():\n{text}"
    if "ModuleNotFoundError" in text or "No module named" in text:
        message += (
            "\nFix: the task factory (and what it imports) must be importable on every worker: define it in an "
            "installed package, or in a module under the folder you start from (local workers share your working "
            "directory), or set PYTHONPATH for the Ray nodes."
        )
    return message


class WorkerGroup:
    """The actors of one run. `worker_cls` is a class attribute so tests can inject a failing subclass."""

    worker_cls: type = TrainWorker

    def __init__(self, scaling: ScalingConfig, seed: int) -> None:
        self.scaling = scaling
        self.seed = seed
        self.actors: list[Any] = []
        self.pg: Any = None

    @property
    def num_workers(self) -> int:
        return self.scaling.num_workers

    def start(self) -> None:
        n, cpus = self.scaling.num_workers, self.scaling.cpus_per_worker
        total = ray.cluster_resources().get("CPU", 0.0)
        if n * cpus > total:
            raise RuntimeError(
                f"ScalingConfig asks for {n} workers x {cpus:g} CPU = {n * cpus:g} CPUs, but the Ray cluster has "
                f"{total:g}. Cluster: {cluster.inventory()}. Use fewer workers or a smaller cpus_per_worker "
                "(fractions such as 0.5 are allowed)."
            )
        timeout = env_float(PLACEMENT_TIMEOUT_S)
        self.pg = placement_group([{"CPU": cpus}] * n, strategy=self.scaling.placement_strategy)
        if not self.pg.wait(timeout_seconds=timeout):
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(
                f"Ray could not reserve {n} workers x {cpus:g} CPU ({self.scaling.placement_strategy}) within "
                f"{timeout:g} s (MIXTRAIN_PLACEMENT_TIMEOUT_S). Cluster: {cluster.inventory()}. Free resources "
                "held by other jobs, use fewer workers, or relax the placement strategy."
            )
        remote: Any = ray.remote(self.worker_cls)
        self.actors = [
            remote.options(
                num_cpus=cpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i, n, self.scaling.num_threads, self.seed)
            for i in range(n)
        ]

    def call(self, method: str, *args: Any, timeout_s: float, ranks: Sequence[int] | None = None) -> list[Any]:
        """Call `method(*args)` on the given ranks (all by default) and return results in rank order."""
        ranks = list(range(self.num_workers)) if ranks is None else list(ranks)
        return self._gather(method, {r: getattr(self.actors[r], method).remote(*args) for r in ranks}, timeout_s)

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
                raise WorkerError(
                    f"worker(s) {missing} did not finish {method}() within {timeout_s:g} s; see the timeouts "
                    "MIXTRAIN_*_TIMEOUT_S in the README"
                )
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                raise WorkerError(_describe(rank_of[ref], method, exc)) from exc
        return [results[r] for r in sorted(results)]

    def shutdown(self) -> None:
        """Leave the process group where possible, then kill the actors and free the resources."""
        if self.actors:
            refs = [a.shutdown.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=5.0)
            for actor in self.actors:
                ray.kill(actor)
            self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
