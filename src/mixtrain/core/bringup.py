"""Bringing a job up, in order: build the replicas, check them, ship the data, measure each device,
form the collective group, measure communication, and make the first plan (which may leave a
worker out and re-form the group without it). Each phase fails fast and names the worker.

`Trainer.fit` trains after this; `Trainer.plan` (and `mixtrain plan`) stops here and prints the plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from mixtrain import compat
from mixtrain._constants import EXCLUDE_GAIN, env_float, transfer_s
from mixtrain.comm import ps_server
from mixtrain.comm.process_group import choose_backend, shared_gpu
from mixtrain.config import ScalingConfig, Slowdown, StrategyConfig
from mixtrain.core import preflight
from mixtrain.core.group_ops import GroupOps, setup_wait_s, user_cap
from mixtrain.core.messages import BuildReport, LeftOut, ProbeResult, WorkerInfo
from mixtrain.core.worker_group import WorkerGroup
from mixtrain.data.sampling import Arrays
from mixtrain.data.sources import Loader
from mixtrain.policies.advice import choose, suggest
from mixtrain.policies.decisions import Decision, LeaveOut, first_plan
from mixtrain.policies.planner import Plan, largest_remainder, resolve_shares
from mixtrain.task import Task


class Phases:
    """Seconds per start-up phase, in the order they ran: where the time to the first step goes."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The phase `name` ended now (a name marked again adds up)."""
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"start-up {sum(self.seconds.values()):.1f} s: {parts}"


@dataclass
class Bringup:
    """What bring-up found and decided: the workers, the first plan, the group's operations."""

    workers: list[WorkerInfo]
    """Per worker (current rank order): node, device, precision, threads."""
    plan: Plan
    """The first plan: shares, micro-batches, predictions, and any exclusion the user should hear of."""
    ops: GroupOps
    """Forms and changes the group (backend, strategy, loss scaling, data refs)."""
    slowdown: Slowdown
    """EMULATION table keyed by the current ranks (workers left out renumber the rest)."""
    notes: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    """The preflight record for metrics.jsonl: reports, numerics, probes, workers left out and why."""
    left_out: list[LeftOut] = field(default_factory=list)
    advice: str = ""
    """The strategy the measured compute and link suggest, with the figures."""
    num_samples: int = 0
    """Training samples (the same on every worker, checked)."""
    num_eval: int = 0
    """Held-out samples (0: no evaluation)."""
    phases: Phases = field(default_factory=Phases)
    """Where the start-up time went."""
    probes: list[ProbeResult] = field(default_factory=list)
    """Per worker (current rank order): what the start-up probe measured."""

    @property
    def backend(self) -> str:
        return self.ops.backend

    @property
    def strategy(self) -> StrategyConfig:
        return self.ops.strategy


@dataclass
class _Found:
    """What bring-up knows of the workers still in (rank order), trimmed as workers are left out."""

    reports: list[BuildReport]
    infos: list[WorkerInfo]
    probes: list[ProbeResult] = field(default_factory=list)

    def drop(self, ranks: list[int]) -> None:
        for rank in sorted(ranks, reverse=True):
            for seq in (self.reports, self.infos, self.probes):
                if rank < len(seq):
                    del seq[rank]


def bring_up(
    group: WorkerGroup,
    task_factory: Callable[[], Task],
    train: Arrays | Loader,
    evaluation: Arrays | Loader | None,
    global_batch: int,
    strategy: StrategyConfig,
    phases: Phases | None = None,
) -> Bringup:
    wait_s = setup_wait_s()
    phases = phases or Phases()
    requested = strategy
    if strategy.name == "auto":  # measured as all-reduce (the exact math), kept unless the link is slow for it
        strategy = strategy.as_allreduce()
    notes: list[str] = []
    left_out: list[LeftOut] = []
    # Build before forming the group, so a factory that raises fails at once instead of
    # leaving its peers waiting out the rendezvous timeout.
    found = _Found(group.call("build", task_factory, timeout_s=wait_s), [])
    phases.mark("worker processes and replicas")
    checks: dict[str, Any] = {"reports": list(found.reports), "numerics": [], "probes": [], "left_out": []}
    preflight.check(compat.versions(), found.reports)
    found.infos = group.call("info", timeout_s=wait_s)
    data_refs = (ray.put(train), ray.put(evaluation) if evaluation is not None else None)  # once; read zero-copy
    data = preflight.check_data(group.call("load_data", *data_refs, timeout_s=wait_s), found.infos)
    phases.mark("data")
    checks["numerics"] = _check_numerics(group, found, left_out, notes)
    slowdown = _slowdown_now(group)
    found.probes = _probe(group, global_batch, slowdown)
    phases.mark("numerics and speed")
    checks["probes"] = list(found.probes)
    if strategy.name.startswith("ps"):
        notes.append(_start_parameter_servers(group, task_factory, strategy, found.reports))
    kinds = [r.device.kind for r in found.reports if r.device is not None]
    sharing = shared_gpu([(r.host, r.device.kind, r.device.uuid) for r in found.reports if r.device is not None])
    backend = choose_backend(group.scaling.backend, kinds, all(r.nccl for r in found.reports), sharing)
    if sharing is not None and group.scaling.backend == "auto" and all(k == "cuda" for k in kinds):
        notes.append(f"backend gloo, not NCCL: workers {sharing[0]} and {sharing[1]} share one GPU")
    ops = GroupOps(
        group,
        strategy=strategy,
        backend=backend,
        loss_scaling=any(r.precision == "fp16" for r in found.reports),
        data_refs=data_refs,
        task_factory=task_factory,
    )
    ops.reference = found.reports[0]
    ops.form()
    phases.mark("collective group")
    while True:
        exchanged = 2 * 6 * max(r.trainable_bytes for r in found.reports)  # up to 6 all-reduces of the gradients
        measured = group.call("measure_comm", timeout_s=transfer_s(exchanged))
        exchange_s, exchange_bytes = max(m[0] for m in measured), max(m[1] for m in measured)
        plan, decision = _first_plan(group, global_batch, found, exchange_s / strategy.steps_per_exchange)
        if not isinstance(decision, LeaveOut):
            break
        info = found.infos[decision.rank]
        left_out.append(LeftOut(info, decision.reason))
        notes.append(f"left out {info.short()}: {decision.reason}")
        ops.leave_out([decision.rank])
        found.drop([decision.rank])
        slowdown = _slowdown_now(group)
    phases.mark("link and plan")
    checks["left_out"] = [{"rank": w.worker.rank, "reason": w.reason} for w in left_out]
    workers = group.call("info", timeout_s=wait_s)
    compute_s = plan.predicted_step_s - (plan.comm_s if group.num_workers > 1 else 0.0)
    advice = suggest(compute_s, exchange_s, exchange_bytes, strategy, group.num_workers)
    if requested.name == "auto":
        chosen = choose(compute_s, exchange_s, requested, group.num_workers, exchange_bytes)  # the options asked for
        if chosen != strategy:
            plan, exchange_s, exchange_bytes = _switch(ops, chosen, global_batch, found, exchanged)
            strategy = chosen
        advice = f"auto chose {strategy.describe()}: {advice}"
    checks["strategy"] = {
        "name": strategy.describe(),
        "requested": requested.name,
        "exchange_s": exchange_s,
        "exchange_bytes": exchange_bytes,
    }
    return Bringup(
        workers=workers,
        plan=plan,
        ops=ops,
        slowdown=slowdown,
        notes=notes,
        checks=checks,
        left_out=left_out,
        advice=advice,
        num_samples=data.num_train,
        num_eval=data.num_eval,
        phases=phases,
        probes=list(found.probes),
    )


def _switch(
    ops: GroupOps, chosen: StrategyConfig, global_batch: int, found: _Found, exchanged: int
) -> tuple[Plan, float, int]:
    """`--strategy auto` adopting another strategy than the all-reduce it measured: the group re-forms with it
    (nothing trained yet: every replica holds rank 0's weights), its exchange is measured, and the shares are
    planned again with that cost (the workers stay those the all-reduce plan kept)."""
    ops.strategy = chosen
    ops.reform()
    measured = ops.group.call("measure_comm", timeout_s=transfer_s(exchanged))
    exchange_s, exchange_bytes = max(m[0] for m in measured), max(m[1] for m in measured)
    plan, _ = _first_plan(ops.group, global_batch, found, exchange_s / chosen.steps_per_exchange)
    return plan, exchange_s, exchange_bytes


def _check_numerics(group: WorkerGroup, found: _Found, left_out: list[LeftOut], notes: list[str]) -> list[Any]:
    """Each device's gradient against the CPU's; under "strict", workers that fail it are left out."""
    scaling = group.scaling
    if scaling.numerics_check == "off":
        return []
    results = group.call("check_numerics", scaling.numerics_tolerance, timeout_s=setup_wait_s())
    lines, bad = preflight.numerics_verdict(results, found.reports)
    notes += [f"numerics check: {line}" for line in lines]
    if bad and scaling.numerics_check == "strict":
        if len(bad) == len(found.reports):
            raise preflight.PreflightError("numerics check (strict): every worker failed it:\n" + "\n".join(lines))
        left_out += [LeftOut(found.infos[r], "failed the numerics check (strict)") for r in bad]
        group.drop(bad)
        found.drop(bad)
        notes.append(f"numerics check (strict): left out worker(s) {bad}; the others were renumbered")
    return results


def _probe(group: WorkerGroup, global_batch: int, slowdown: Slowdown) -> list[ProbeResult]:
    n = group.num_workers
    args = [
        (math.ceil(global_batch / n), global_batch, _factor(slowdown, i), user_cap(group.scaling, spec))
        for i, spec in enumerate(group.specs)
    ]
    return group.call_each("probe", args, timeout_s=setup_wait_s())


def _start_parameter_servers(
    group: WorkerGroup, task_factory: Callable[[], Task], strategy: StrategyConfig, reports: list[BuildReport]
) -> str:
    trainable_bytes = max(r.trainable_bytes for r in reports)
    shards = ps_server.num_shards(strategy.ps_shards, trainable_bytes)
    group.servers = ps_server.start(task_factory, shards, group.seed, strategy.compress, strategy.ps_node)
    return f"parameter servers: {shards} shard(s) for {trainable_bytes / 2**20:,.1f} MB of parameters"


def _first_plan(group: WorkerGroup, global_batch: int, found: _Found, comm_s: float) -> tuple[Plan, Decision]:
    scaling = group.scaling
    return first_plan(
        speeds=[p.samples_per_s for p in found.probes],
        global_batch=global_batch,
        memory_caps=[p.memory_cap for p in found.probes],
        comm_s=comm_s,
        min_gain=env_float(EXCLUDE_GAIN),
        fixed_shares=None if scaling.balanced else _fixed_shares(scaling, global_batch, group),
        leave_out_slow=scaling.leave_out_slow,
    )


def _slowdown_now(group: WorkerGroup) -> Slowdown:
    """The EMULATION table (keyed by starting rank) re-keyed by current rank."""
    table = group.scaling.slowdown()
    return {i: table[spec.rank] for i, spec in enumerate(group.specs) if spec.rank in table}


def _factor(slowdown: Slowdown, rank: int) -> float:
    """The emulated factor in force from the first round (what the probe should see)."""
    factor, first_round = slowdown.get(rank, (1.0, 0))
    return factor if first_round == 0 else 1.0


def _fixed_shares(scaling: ScalingConfig, global_batch: int, group: WorkerGroup) -> list[int]:
    """Fixed shares for the workers that are left: entries of workers left out are dropped and the
    rest rescaled to the global batch."""
    shares = scaling.shares
    n = group.num_workers
    if not isinstance(shares, str) and len(shares) != n:
        kept = [shares[s.rank] for s in group.specs]
        shares = largest_remainder([float(k) for k in kept], global_batch)
    return resolve_shares(shares, global_batch, n)
