"""Between rounds: pace the rounds, evaluate, record. Workers do the steps; this decides what comes next."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mixtrain._constants import (
    COLLECTIVE_TIMEOUT_S,
    EXCLUDE_GAIN,
    REBALANCE_THRESHOLD,
    ROUND_TARGET_S,
    ROUND_TIMEOUT_S,
    env_float,
)
from mixtrain.config import Slowdown
from mixtrain.data import steps_per_epoch
from mixtrain.planner import Plan, equal_shares, make_plan, micro_batches, needs_rebalance, plan_record, plan_table
from mixtrain.progress import ProgressView
from mixtrain.rounds import RoundPlan, next_round_steps, summarize_round
from mixtrain.runlog import RunLog
from mixtrain.worker_group import WorkerGroup

EXCLUDE_ROUNDS = 2
"""Measured rounds in a row that must find a worker slowing the job down before it is left out."""
STEP_CHANGE = 0.5
"""A measured speed this far (relative) from the smoothed one replaces it instead of being averaged in:
far above round-to-round noise (about 30% for short rounds on a busy machine), far below a 3x throttle."""


@dataclass
class EpochPlan:
    num_samples: int
    global_batch: int
    shares: list[int]
    steps_per_round: int | None
    drift_tolerance: float
    num_eval: int
    balanced: bool = False
    """Follow measured speed (shares='auto'); otherwise the shares stay fixed."""
    max_micro_batch: list[int | None] | None = None
    slowdown: Slowdown = field(default_factory=dict)
    """EMULATION: rank -> (factor, first round)."""
    speeds: list[float] | None = None
    """Compute samples/s per worker measured before training (the probe); rounds refine it."""
    leave_out_slow: bool = False
    """Leave out a worker that measurably slows the job down (balanced shares only)."""


class Controller:
    def __init__(
        self,
        group: WorkerGroup,
        plan: EpochPlan,
        log: RunLog,
        view: ProgressView,
        workers: list[dict[str, Any]],
        regroup: Callable[[int], None] | None = None,
    ) -> None:
        """`regroup(rank)` stops that worker and re-forms the group with the rest (renumbered)."""
        self.group = group
        self.workers = list(workers)
        self.plan = plan
        self.log = log
        self.view = view
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.shares = list(plan.shares)
        self.speeds = list(plan.speeds) if plan.speeds else None  # compute samples/s per worker, smoothed
        self.comm_s = 0.0  # communication per step, measured in the last round
        self.regroup = regroup
        self._reported_exclusions: set[int] = set()
        self._votes, self._vote_rank = 0, -1  # measured rounds in a row that would leave out _vote_rank

    def run(self, epochs: int) -> None:
        p = self.plan
        num_steps = steps_per_epoch(p.num_samples, p.global_batch)
        round_steps = p.steps_per_round or 2  # a short first round measures the step time
        round_timeout = env_float(ROUND_TIMEOUT_S) + env_float(COLLECTIVE_TIMEOUT_S)
        for epoch in range(epochs):
            step = 0
            while step < num_steps:
                k = min(round_steps, num_steps - step)
                rplan = RoundPlan(
                    epoch,
                    step,
                    k,
                    tuple(self.shares),
                    p.global_batch,
                    p.drift_tolerance,
                    tuple(micro_batches(self.shares, p.max_micro_batch)),
                    self._slowdown(len(self.history)),
                )
                t0 = time.perf_counter()
                reports = self.group.call("run_round", rplan, timeout_s=round_timeout)
                record = summarize_round(rplan, reports, time.perf_counter() - t0)
                self.history.append(record)
                self.log.write("round", record)
                self.view.round_done(record)
                if record["rebroadcast"]:
                    self.view.log(f"replicas drifted by {record['drift']:.2e}: rank 0's weights re-broadcast")
                step += k
                if len(self.history) > 1:  # the first round is warm-up (allocations, caches), not a measurement
                    self._measure(record)
                    if p.balanced:
                        self._rebalance(record)
                round_steps = next_round_steps(record["wall_s"] / k, env_float(ROUND_TARGET_S), p.steps_per_round)
            self._end_epoch(epoch)

    def _slowdown(self, round_index: int) -> tuple[float, ...]:
        if not self.plan.slowdown:
            return ()
        table = self.plan.slowdown
        return tuple(table[r][0] if r in table and round_index >= table[r][1] else 1.0 for r in range(len(self.shares)))

    def _measure(self, record: dict[str, Any]) -> None:
        """Each worker's compute speed (samples per compute-second), smoothed over rounds; a step
        change (a laptop starting to throttle) is taken at once instead of being averaged in slowly."""
        new = [w["samples"] / w["compute_s"] if w["compute_s"] > 0 else 0.0 for w in record["workers"]]
        self.comm_s = max(w["comm_s"] for w in record["workers"]) / record["num_steps"]
        if self.speeds is None:
            self.speeds = new
        else:
            self.speeds = [
                cur if old <= 0 or abs(cur - old) / old > STEP_CHANGE else 0.5 * old + 0.5 * cur
                for old, cur in zip(self.speeds, new)
            ]

    def _rebalance(self, record: dict[str, Any]) -> None:
        """Leave out a worker that measurably slows the job down (when allowed, after EXCLUDE_ROUNDS rounds
        in a row say so); otherwise re-plan when the measured imbalance passes the threshold (hysteresis
        against flapping)."""
        assert self.speeds is not None
        plan = make_plan(
            self.speeds,
            self.plan.global_batch,
            memory_caps=self.plan.max_micro_batch,
            comm_s=self.comm_s,
            min_gain=env_float(EXCLUDE_GAIN),
        )
        if plan.excluded and self.plan.leave_out_slow and self.regroup is not None:
            rank, reason = next(iter(plan.excluded.items()))
            self._votes = self._votes + 1 if self._vote_rank == rank else 1
            self._vote_rank = rank
            if self._votes >= EXCLUDE_ROUNDS:
                self._leave_out(rank, reason)
                return
        else:
            self._votes, self._vote_rank = 0, -1
        per_step = [w["compute_s"] / record["num_steps"] for w in record["workers"]]
        if not needs_rebalance(per_step, env_float(REBALANCE_THRESHOLD)) or plan.shares == self.shares:
            return
        self._adopt(plan, f"re-planned after round {len(self.history)}")

    def _adopt(self, plan: Plan, title: str) -> None:
        self.shares = plan.shares
        self.log.write("plan", {"after_round": len(self.history), **plan_record(plan)})
        excluded = {r: why for r, why in plan.excluded.items() if r not in self._reported_exclusions}
        self._reported_exclusions.update(excluded)
        shown = replace(plan, excluded=excluded)  # a worker that slows the job is named once, not every re-plan
        self.view.log(plan_table(shown, self.workers, title))

    def _leave_out(self, rank: int, reason: str) -> None:
        """Between rounds every replica holds the same state, so the others re-form the group and go on:
        nothing is lost and the epoch's sample order is unchanged (only the split of each batch is)."""
        assert self.regroup is not None and self.speeds is not None
        info = self.workers[rank]
        self.regroup(rank)
        self.log.write("left_out", {"after_round": len(self.history), "worker": info, "reason": reason})
        self.view.log(f"left out worker {rank} ({info['device_name']} on {info['host']}): {reason}")
        for seq in (self.workers, self.speeds, self.plan.max_micro_batch):
            if seq:
                del seq[rank]
        self.plan.slowdown = {r - (r > rank): v for r, v in self.plan.slowdown.items() if r != rank}
        self._votes, self._vote_rank, self._reported_exclusions = 0, -1, set()
        plan = make_plan(self.speeds, self.plan.global_batch, memory_caps=self.plan.max_micro_batch)
        self._adopt(plan, f"re-planned without worker {rank} after round {len(self.history)}")

    def _end_epoch(self, epoch: int) -> None:
        rounds = [r for r in self.history if r["epoch"] == epoch]
        samples = sum(r["samples"] for r in rounds)
        wall = sum(r["wall_s"] for r in rounds)
        line = f"epoch {epoch}: loss {rounds[-1]['last_loss']:.4f}  {samples / wall:,.0f} samples/s"
        if self.plan.num_eval:
            ev = self.evaluate()
            ev["epoch"] = epoch
            self.evals.append(ev)
            self.log.write("eval", ev)
            line += f"  held-out loss {ev['loss']:.4f}"
            if "accuracy" in ev:
                line += f"  accuracy {ev['accuracy']:.4f}"
        self.view.log(line)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, each worker taking a contiguous slice of the eval set."""
        sizes = equal_shares(self.plan.num_eval, self.group.num_workers)  # zeros when fewer samples than workers
        bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        parts = self.group.call_each("evaluate", bounds, timeout_s=env_float(ROUND_TIMEOUT_S))
        total = {k: sum(part[k] for part in parts) for k in parts[0]}
        out = {"loss": total["loss_sum"] / total["samples"], "samples": total["samples"]}
        if total["targets"]:
            out["accuracy"] = total["correct"] / total["targets"]
        return out
