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
from typing import TYPE_CHECKING, Any

import ray

from mixtrain import compat
from mixtrain.comm import ps_server
from mixtrain.comm.process_group import group_backend
from mixtrain.config import ScalingConfig, StrategyConfig
from mixtrain.data.sampling import Arrays, steps_per_epoch
from mixtrain.data.sources import Loader
from mixtrain.frozen_base import FrozenBase
from mixtrain.group import preflight
from mixtrain.group.group_ops import GroupOps
from mixtrain.group.membership import Membership, user_cap
from mixtrain.group.worker_group import WorkerGroup
from mixtrain.policies import shard_choice
from mixtrain.policies.advice import choose, suggest
from mixtrain.policies.decisions import Decision, LeaveOut, first_plan
from mixtrain.policies.planner import Plan, largest_remainder, resolve_shares
from mixtrain.pretrained import HFModelSpec
from mixtrain.records.messages import BuildReport, DataReport, LeftOut, ProbeResult, WorkerInfo
from mixtrain.task import Task

if TYPE_CHECKING:
    from mixtrain.policies.model_shape import ModelShape


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

    def strategy_line(self) -> str:
        """The strategy, and how much state is sliced (and offloaded), for the start-of-run lines."""
        scaling = self.ops.group.scaling
        sliced = f", state sliced by memory: {scaling.shard}" if scaling.shard != "none" else ""
        offload = ", optimizer on the host" if scaling.offload != "none" else ""
        return f"strategy: {self.strategy.describe()}{sliced}{offload}; measured: {self.advice}"

    @property
    def frozen(self) -> FrozenBase | None:
        """The model's frozen parameters (rank 0's report), when it has some: checkpoints leave them out."""
        return self.ops.reference.frozen if self.ops.reference is not None else None

    @property
    def hf_model(self) -> HFModelSpec | None:
        """Rank 0's Hugging Face model class and config (None: another kind of model)."""
        return self.ops.reference.hf_model if self.ops.reference is not None else None


def bring_up(
    group: WorkerGroup,
    task_factory: Callable[[], Task],
    train: Arrays | Loader,
    evaluation: Arrays | Loader | None,
    global_batch: int,
    strategy: StrategyConfig,
    phases: Phases | None = None,
    eval_every: int | None = None,
) -> Bringup:
    """Build, check, ship the data, measure, form, plan: everything before the first step. Each member's report,
    probe, speed, memory cap and share are recorded in the membership. `eval_every` (steps, or None): rounds
    end there as at each epoch's end, which the advice for `--strategy auto` weighs."""
    phases = phases or Phases()
    requested = strategy
    if strategy.name == "auto":  # measured as all-reduce (the exact math), kept unless the link is slow for it
        strategy = strategy.as_allreduce()
    notes: list[str] = []
    left_out: list[LeftOut] = []
    reports = _build(group, task_factory)
    phases.mark("worker processes and replicas")
    checks: dict[str, Any] = {"reports": reports, "numerics": [], "probes": [], "left_out": []}
    if group.scaling.shard == "auto":  # resolved before anything reads it: the probe, the strategy, the final gather
        group.scaling, choice = shard_choice.resolve(group.scaling, _shape(reports), _seen(group, reports))
        notes.append(choice.line)
        checks["shard"] = choice.record()
    data_refs, data = _ship_data(group, train, evaluation)
    phases.mark("data")
    checks["numerics"] = _check_numerics(group, left_out, notes)
    checks["probes"] = _probe(group, global_batch)
    phases.mark("numerics and speed")
    if strategy.name.startswith("ps"):
        notes.append(_start_parameter_servers(group, task_factory, strategy))
    ops = _group_ops(group, strategy, data_refs, task_factory, notes)
    ops.form()
    phases.mark("collective group")
    plan, exchange_s, exchange_bytes, exchanged = _plan_leaving_out(ops, global_batch, left_out, notes)
    phases.mark("link and plan")
    checks["left_out"] = [{"rank": w.worker.rank, "reason": w.reason} for w in left_out]
    workers = _refresh_infos(group)
    round_limit = min(steps_per_epoch(data.num_train, global_batch), eval_every or math.inf)
    advised = _advise(ops, requested, plan, exchange_s, exchange_bytes, exchanged, int(round_limit))
    plan, advice, exchange_s, exchange_bytes = advised
    checks["strategy"] = dict(
        name=ops.strategy.describe(), requested=requested.name, exchange_s=exchange_s, exchange_bytes=exchange_bytes
    )
    _adopt_first(group.members, plan)
    return Bringup(
        workers=workers,
        plan=plan,
        ops=ops,
        notes=notes,
        checks=checks,
        left_out=left_out,
        advice=advice,
        num_samples=data.num_train,
        num_eval=data.num_eval,
        phases=phases,
        probes=[m.probe for m in group.members if m.probe is not None],
    )


def _ship_data(
    group: WorkerGroup, train: Arrays | Loader, evaluation: Arrays | Loader | None
) -> tuple[tuple[Any, Any], DataReport]:
    """The data put into the object store once (each worker reads it zero-copy), loaded by every worker, and the
    workers' reports checked to agree."""
    refs = (ray.put(train), ray.put(evaluation) if evaluation is not None else None)
    reports = group.each(lambda w: w.load_data(*refs), timeout_s=group.tunables.setup_s)
    return refs, preflight.check_data(reports, group.members.infos())


def _build(group: WorkerGroup, task_factory: Callable[[], Task]) -> list[BuildReport]:
    """Every worker builds its replica (before any group forms, so a factory that raises fails at once instead of
    leaving its peers waiting out the rendezvous timeout); the reports must agree (preflight)."""
    built = group.each(lambda w: w.build(task_factory), timeout_s=group.tunables.setup_s)
    for member, report in zip(group.members, built):
        member.report = report
    preflight.check(compat.versions(), built)
    _refresh_infos(group)
    return built


def _shape(reports: list[BuildReport]) -> ModelShape:
    shape = reports[0].shape
    assert shape is not None, "every worker built (preflight.check)"
    return shape


def _seen(group: WorkerGroup, reports: list[BuildReport]) -> list[shard_choice.Seen]:
    """Each worker's device as its build report saw it, for shard="auto"."""
    seen = []
    for member, r in zip(group.members, reports, strict=True):
        assert r.device is not None, "every worker built (preflight.check)"
        seen.append(shard_choice.Seen(member.spec.rank, r.host, r.device.kind, r.device.uuid, r.device.free_memory))
    return seen


def _advise(
    ops: GroupOps,
    requested: StrategyConfig,
    plan: Plan,
    exchange_s: float,
    exchange_bytes: int,
    exchanged: int,
    round_limit: int,
) -> tuple[Plan, str, float, int]:
    """What the measured compute and link suggest; with `--strategy auto`, the strategy they call for is adopted
    (the group re-forms with it and the plan is made again). Returns (plan, advice, exchange s, exchange bytes)."""
    n, strategy = len(ops.members), ops.strategy
    compute_s = plan.predicted_step_s - (plan.comm_s if n > 1 else 0.0)
    advice = suggest(compute_s, exchange_s, exchange_bytes, strategy, n, round_limit)
    if requested.name != "auto":
        return plan, advice, exchange_s, exchange_bytes
    chosen = choose(compute_s, exchange_s, requested, n, exchange_bytes, round_limit)  # the options asked for
    if chosen != strategy:
        plan, exchange_s, exchange_bytes = _switch(ops, chosen, plan, exchanged)
    return plan, f"auto chose {ops.strategy.describe()}: {advice}", exchange_s, exchange_bytes


def _refresh_infos(group: WorkerGroup) -> list[WorkerInfo]:
    """Who each worker is now (ranks renumber as workers are left out)."""
    infos = group.each(lambda w: w.info(), timeout_s=group.tunables.setup_s)
    for member, info in zip(group.members, infos):
        member.info = info
    return infos


def _group_ops(
    group: WorkerGroup,
    strategy: StrategyConfig,
    data_refs: tuple[Any, Any],
    task_factory: Callable[[], Task],
    notes: list[str],
) -> GroupOps:
    """The group's operations, with the backend the devices allow (NCCL only where every worker is CUDA with a
    GPU of its own) and rank 0's build report to check replacements against."""
    reports = [m.report for m in group.members if m.report is not None and m.report.device is not None]
    devices = [(r.host, r.device.kind, r.device.uuid, r.nccl) for r in reports if r.device is not None]
    backend, note = group_backend(group.scaling.backend, devices)
    notes += [note] if note else []
    ops = GroupOps(
        group,
        strategy=strategy,
        backend=backend,
        loss_scaling=any(r.precision == "fp16" for r in reports),
        data_refs=data_refs,
        task_factory=task_factory,
    )
    ops.reference = group.members[0].report
    return ops


def _plan_leaving_out(
    ops: GroupOps, global_batch: int, left_out: list[LeftOut], notes: list[str]
) -> tuple[Plan, float, int, int]:
    """Measure the exchange and plan; a worker the plan would leave out is left out and it all happens again
    without it. Returns (plan, exchange seconds, exchange bytes, the bytes the measurement may move)."""
    members = ops.members
    while True:
        exchanged = 2 * 6 * max(m.report.trainable_bytes for m in members if m.report is not None)  # 6 all-reduces
        exchange_s, exchange_bytes = _measure_exchange(ops, exchanged)
        plan, decision = _first_plan(ops.group, global_batch, exchange_s / ops.strategy.steps_per_exchange)
        if not isinstance(decision, LeaveOut):
            return plan, exchange_s, exchange_bytes, exchanged
        member = members[decision.rank]
        assert member.info is not None
        left_out.append(LeftOut(member.info, decision.reason))
        notes.append(f"left out {member.info.short()}: {decision.reason}")
        ops.leave_out([decision.rank])


def _measure_exchange(ops: GroupOps, exchanged: int) -> tuple[float, int]:
    measured = ops.group.each(lambda w: w.measure_comm(), timeout_s=ops.tunables.transfer_s(exchanged))
    return max(m[0] for m in measured), max(m[1] for m in measured)


def _switch(ops: GroupOps, chosen: StrategyConfig, plan: Plan, exchanged: int) -> tuple[Plan, float, int]:
    """`--strategy auto` adopting another strategy than the all-reduce it measured: the group re-forms with it
    (nothing trained yet: every replica holds rank 0's weights), its exchange is measured, and the shares are
    planned again with that cost (the workers stay those the all-reduce plan kept)."""
    ops.strategy = chosen
    ops.reform()
    exchange_s, exchange_bytes = _measure_exchange(ops, exchanged)
    plan, _ = _first_plan(ops.group, sum(plan.shares), exchange_s / chosen.steps_per_exchange)
    return plan, exchange_s, exchange_bytes


def _check_numerics(group: WorkerGroup, left_out: list[LeftOut], notes: list[str]) -> list[Any]:
    """Each device's gradient against the CPU's; under "strict", workers that fail it are left out."""
    scaling, members = group.scaling, group.members
    if scaling.numerics_check == "off":
        return []
    results = group.each(lambda w: w.check_numerics(scaling.numerics_tolerance), timeout_s=group.tunables.setup_s)
    reports = [m.report for m in members if m.report is not None]
    lines, bad = preflight.numerics_verdict(results, reports)
    notes += [f"numerics check: {line}" for line in lines]
    if bad and scaling.numerics_check == "strict":
        if len(bad) == len(members):
            raise preflight.PreflightError("numerics check (strict): every worker failed it:\n" + "\n".join(lines))
        left_out += [
            LeftOut(info, "failed the numerics check (strict)") for r, info in enumerate(members.infos()) if r in bad
        ]
        group.drop(bad)
        notes.append(f"numerics check (strict): left out worker(s) {bad}; the others were renumbered")
    return results


def _probe(group: WorkerGroup, global_batch: int) -> list[ProbeResult]:
    """Each device's speed (and, on accelerators, its largest micro-batch), recorded on its member."""
    members = group.members
    n = len(members)
    probes = group.gather(
        {
            r: m.worker.probe(
                math.ceil(global_batch / n),
                global_batch,
                user_cap(group.scaling, m.spec),
                forward_only=group.scaling.shard in ("gradients", "full"),
            )
            for r, m in enumerate(members)
        },
        group.tunables.setup_s,
    )
    for member, probe in zip(members, probes):
        member.probe, member.speed, member.memory_cap = probe, probe.samples_per_s, probe.memory_cap
    return probes


def _start_parameter_servers(group: WorkerGroup, task_factory: Callable[[], Task], strategy: StrategyConfig) -> str:
    trainable_bytes = max(m.report.trainable_bytes for m in group.members if m.report is not None)
    shards = ps_server.num_shards(strategy.ps.shards, trainable_bytes)
    group.servers = ps_server.start(
        task_factory, shards, group.seed, strategy.compress, strategy.ps.node, group.tunables.collective_timeout_s
    )
    return f"parameter servers: {shards} shard(s) for {trainable_bytes / 2**20:,.1f} MB of parameters"


def _first_plan(group: WorkerGroup, global_batch: int, comm_s: float) -> tuple[Plan, Decision]:
    scaling, members = group.scaling, group.members
    return first_plan(
        speeds=[m.probe.samples_per_s for m in members if m.probe is not None],
        global_batch=global_batch,
        memory_caps=[m.probe.memory_cap for m in members if m.probe is not None],
        comm_s=comm_s,
        min_gain=group.tunables.exclude_gain,
        fixed_shares=None if scaling.balanced else _fixed_shares(scaling, global_batch, group),
        leave_out_slow=scaling.leave_out_slow,
    )


def _adopt_first(members: Membership, plan: Plan) -> None:
    """The first plan's shares, memory caps and speeds become the members' own."""
    members.set_shares(plan.shares)
    for member, cap in zip(members, plan.memory_caps):
        member.memory_cap = cap
    if plan.speeds:
        members.set_speeds(plan.speeds)


def _fixed_shares(scaling: ScalingConfig, global_batch: int, group: WorkerGroup) -> list[int]:
    """Fixed shares for the workers that are left: entries of workers left out are dropped and the
    rest rescaled to the global batch."""
    shares = scaling.shares
    n = len(group.members)
    if not isinstance(shares, str) and len(shares) != n:
        kept = [shares[m.spec.rank] for m in group.members]
        shares = largest_remainder([float(k) for k in kept], global_batch)
    return resolve_shares(shares, global_batch, n)
