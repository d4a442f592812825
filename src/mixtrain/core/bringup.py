"""Bringing a job up, in order: build the replicas, check them, ship the data, measure each device,
form the collective group, measure communication, and make the first plan (which may leave a
worker out and re-form the group without it). Each phase fails fast and names the worker.

`Trainer.fit` trains after this; `Trainer.plan` (and `mixtrain plan`) stops here and prints the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from mixtrain import compat
from mixtrain._constants import BUCKET_MB, COLLECTIVE_TIMEOUT_S, EXCLUDE_GAIN, RENDEZVOUS_TIMEOUT_S, env_float
from mixtrain.cluster.placement import WorkerSpec
from mixtrain.comm import ps_server
from mixtrain.comm.process_group import choose_backend
from mixtrain.config import ScalingConfig, Slowdown, StrategyConfig
from mixtrain.core import preflight
from mixtrain.core.worker_group import WorkerGroup
from mixtrain.data.sampling import Arrays
from mixtrain.policies.advice import suggest
from mixtrain.policies.planner import Plan, largest_remainder, make_plan, resolve_shares
from mixtrain.task import Task


@dataclass
class Bringup:
    workers: list[dict[str, Any]]
    """Per worker (current rank order): node, device, precision, threads."""
    backend: str
    loss_scaling: bool
    """One job-wide fp16 loss scale (some worker computes in fp16)."""
    plan: Plan
    """The first plan: shares, micro-batches, predictions, and any exclusion the user should hear of."""
    slowdown: Slowdown
    """EMULATION table keyed by the current ranks (workers left out renumber the rest)."""
    notes: list[str] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)
    """The preflight record for metrics.jsonl: reports, numerics, probes, workers left out and why."""
    left_out: list[dict[str, Any]] = field(default_factory=list)
    """Workers left out: {"worker": info, "reason": ...}."""
    data_refs: tuple[Any, Any] = (None, None)
    """The training and held-out data in Ray's object store (a replacement worker loads them too)."""
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    advice: str = ""
    """The strategy the measured compute and link suggest, with the figures."""


def bring_up(
    group: WorkerGroup,
    task_factory: Callable[[], Task],
    train: Arrays,
    evaluation: Arrays | None,
    global_batch: int,
    strategy: StrategyConfig,
) -> Bringup:
    scaling = group.scaling
    wait_s = _setup_wait_s()
    notes: list[str] = []
    checks: dict[str, Any] = {"reports": [], "numerics": [], "probes": [], "left_out": []}
    left_out: list[dict[str, Any]] = []
    # Build before forming the group, so a factory that raises fails at once instead of
    # leaving its peers waiting out the rendezvous timeout.
    reports = group.call("build", task_factory, timeout_s=wait_s)
    checks["reports"] = reports
    preflight.check(compat.versions(), reports)
    infos = group.call("info", timeout_s=wait_s)
    train_ref = ray.put(train)  # once; workers read it zero-copy from the object store
    eval_ref = ray.put(evaluation) if evaluation is not None else None
    group.call("load_data", train_ref, eval_ref, timeout_s=wait_s)

    if scaling.numerics_check != "off":
        results = group.call("check_numerics", scaling.numerics_tolerance, timeout_s=wait_s)
        checks["numerics"] = results
        lines, bad = preflight.numerics_verdict(results, reports)
        notes += [f"numerics check: {line}" for line in lines]
        if bad and scaling.numerics_check == "strict":
            if len(bad) == len(reports):
                raise preflight.PreflightError("numerics check (strict): every worker failed it:\n" + "\n".join(lines))
            for r in bad:
                left_out.append({"worker": infos[r], "reason": "failed the numerics check (strict)"})
            group.drop(bad)
            reports = [r for r in reports if r["rank"] not in bad]
            infos = [i for i in infos if i["rank"] not in bad]
            notes.append(f"numerics check (strict): left out worker(s) {bad}; the others were renumbered")

    slowdown = _slowdown_now(group)
    n = group.num_workers
    probes = group.call_each(
        "probe",
        [
            (math.ceil(global_batch / n), global_batch, _factor(slowdown, i), _user_cap(scaling, spec))
            for i, spec in enumerate(group.specs)
        ],
        timeout_s=wait_s,
    )
    checks["probes"] = probes
    speeds = [p["samples_per_s"] for p in probes]
    caps = [p["memory_cap"] for p in probes]

    if strategy.name.startswith("ps"):
        trainable_bytes = max(r["trainable_bytes"] for r in reports)
        shards = ps_server.num_shards(strategy.ps_shards, trainable_bytes)
        group.servers = ps_server.start(task_factory, shards, group.seed, strategy.compress, strategy.ps_node)
        notes.append(f"parameter servers: {shards} shard(s) for {trainable_bytes / 2**20:,.1f} MB of parameters")
    backend = choose_backend(scaling.backend, [r["device"]["kind"] for r in reports], all(r["nccl"] for r in reports))
    loss_scaling = any(r["precision"] == "fp16" for r in reports)
    form_group(group, strategy, backend, loss_scaling)
    gain = env_float(EXCLUDE_GAIN)
    while True:
        measured = group.call("measure_comm", timeout_s=env_float(COLLECTIVE_TIMEOUT_S))
        exchange_s, exchange_bytes = max(m[0] for m in measured), max(m[1] for m in measured)
        comm_s = exchange_s / strategy.steps_per_exchange
        if not scaling.balanced:
            fixed = _fixed_shares(scaling, global_batch, group)
            plan = make_plan(speeds, global_batch, shares=fixed, memory_caps=caps, comm_s=comm_s, min_gain=gain)
            break
        plan = make_plan(speeds, global_batch, memory_caps=caps, comm_s=comm_s, min_gain=gain)
        if not plan.excluded or not scaling.leave_out_slow:
            break
        rank, reason = next(iter(plan.excluded.items()))
        info = infos[rank]
        left_out.append({"worker": info, "reason": reason})
        notes.append(f"left out worker {info['rank']} ({info['device_name']} on {info['host']}): {reason}")
        leave_out(group, [rank])
        for seq in (speeds, caps, reports, infos):
            del seq[rank]
        slowdown = _slowdown_now(group)
        form_group(group, strategy, backend, loss_scaling)
    checks["left_out"] = [{"rank": w["worker"]["rank"], "reason": w["reason"]} for w in left_out]
    workers = group.call("info", timeout_s=wait_s)
    compute_s = plan.predicted_step_s - (plan.comm_s if group.num_workers > 1 else 0.0)
    advice = suggest(compute_s, exchange_s, exchange_bytes, strategy, group.num_workers)
    checks["strategy"] = {"name": strategy.describe(), "exchange_s": exchange_s, "exchange_bytes": exchange_bytes}
    return Bringup(
        workers, backend, loss_scaling, plan, slowdown, notes, checks, left_out, (train_ref, eval_ref), strategy, advice
    )


def form_group(group: WorkerGroup, strategy: StrategyConfig, backend: str, loss_scaling: bool) -> None:
    """Rendezvous at rank 0, join the collective group, set up the strategy (rank 0's weights go to all)."""
    rendezvous_s = env_float(RENDEZVOUS_TIMEOUT_S)
    collective_s = env_float(COLLECTIVE_TIMEOUT_S)
    host, port = group.call("open_rendezvous", rendezvous_s, timeout_s=rendezvous_s, ranks=[0])[0]
    bucket_bytes = int(env_float(BUCKET_MB) * 2**20)
    group.call(
        "join",
        host,
        port,
        rendezvous_s,
        collective_s,
        strategy,
        bucket_bytes,
        backend,
        loss_scaling,
        tuple(group.servers),
        timeout_s=rendezvous_s + collective_s + 10,
    )


def leave_out(group: WorkerGroup, ranks: list[int], rollback: bool = False, lost: bool = False) -> None:
    """Every other worker leaves the group (first rolling back to the start of a failed round when
    `rollback`), then `ranks` are stopped and the rest renumbered (form_group next). Workers that were
    `lost` (dead, or stopped and about to be killed) are not asked anything, and a replacement may
    later start in their place; workers left out by choice are not replaced."""
    keep = [r for r in range(group.num_workers) if r not in ranks]
    group.call("rollback" if rollback else "leave", timeout_s=env_float(COLLECTIVE_TIMEOUT_S), ranks=keep)
    group.drop(ranks, replaceable=lost)


def admit_replacements(
    group: WorkerGroup, up: Bringup, task_factory: Callable[[], Task], global_batch: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Between rounds: replacements whose replica is built (a node that came back, a restarted process)
    pass preflight against rank 0, load the data, are measured, receive rank 0's current training state
    and join the re-formed group as the last ranks. Returns (info, probe) per worker that joined."""
    ready = group.poll_replacements(task_factory)
    if not ready:
        return []
    wait_s = _setup_wait_s()
    reference = up.checks["reports"][0]
    joining = []
    for spec, actor, report in ready:
        if "problem" in report:
            found = [report["problem"]]
        else:
            found = preflight.problems(compat.versions(), [reference, report])
        if found:
            up.notes.append(f"a replacement on {report.get('host')} was refused: {'; '.join(found)}")
            group.discard(spec, actor)
            continue
        joining.append((spec, actor))
    if not joining:
        return []
    state_ref = ray.put(group.call("training_state", timeout_s=wait_s, ranks=[0])[0])
    n = group.num_workers + len(joining)
    probes = []
    for spec, actor in joining:
        ray.get(actor.load_data.remote(*up.data_refs), timeout=wait_s)
        cap = _user_cap(group.scaling, spec)
        probes.append(ray.get(actor.probe.remote(math.ceil(global_batch / n), global_batch, 1.0, cap), timeout=wait_s))
        ray.get(actor.load_training_state.remote(state_ref, None), timeout=wait_s)
    group.call("leave", timeout_s=env_float(COLLECTIVE_TIMEOUT_S))
    first = group.num_workers
    for spec, actor in joining:
        group.admit(spec, actor)
    form_group(group, up.strategy, up.backend, up.loss_scaling)
    infos = group.call("info", timeout_s=wait_s, ranks=list(range(first, group.num_workers)))
    return list(zip(infos, probes))


def _setup_wait_s() -> float:
    """How long building, loading and probing a worker may take (it may compile kernels)."""
    return env_float(RENDEZVOUS_TIMEOUT_S) + 600


def _user_cap(scaling: ScalingConfig, spec: WorkerSpec) -> int | None:
    """The user's max_micro_batch for this worker (by its starting rank), or None: measure it."""
    return scaling.max_micro_batch[spec.rank] if scaling.max_micro_batch else None


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
