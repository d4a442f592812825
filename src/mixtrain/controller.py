"""Between rounds: pace the rounds, evaluate, record. Workers do the steps; this decides what comes next."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mixtrain._constants import (
    COLLECTIVE_TIMEOUT_S,
    REBALANCE_THRESHOLD,
    ROUND_TARGET_S,
    ROUND_TIMEOUT_S,
    env_float,
)
from mixtrain.config import Slowdown
from mixtrain.data import steps_per_epoch
from mixtrain.planner import Plan, equal_shares, make_plan, micro_batches, needs_rebalance
from mixtrain.progress import ProgressView
from mixtrain.rounds import RoundPlan, next_round_steps, summarize_round
from mixtrain.runlog import RunLog
from mixtrain.worker_group import WorkerGroup

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


class Controller:
    def __init__(self, group: WorkerGroup, plan: EpochPlan, log: RunLog, view: ProgressView) -> None:
        self.group = group
        self.plan = plan
        self.log = log
        self.view = view
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.shares = list(plan.shares)
        self.speeds: list[float] | None = None  # samples/s of compute per worker, smoothed over rounds
        self._reported_exclusions: set[int] = set()

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
        if self.speeds is None:
            self.speeds = new
        else:
            self.speeds = [
                cur if old <= 0 or abs(cur - old) / old > STEP_CHANGE else 0.5 * old + 0.5 * cur
                for old, cur in zip(self.speeds, new)
            ]

    def _rebalance(self, record: dict[str, Any]) -> None:
        """Re-plan when the measured imbalance passes the threshold (hysteresis against flapping)."""
        assert self.speeds is not None
        per_step = [w["compute_s"] / record["num_steps"] for w in record["workers"]]
        if not needs_rebalance(per_step, env_float(REBALANCE_THRESHOLD)):
            return
        plan = make_plan(self.speeds, self.plan.global_batch, memory_caps=self.plan.max_micro_batch)
        if plan.shares == self.shares:
            return
        self.shares = plan.shares
        self.log.write(
            "plan",
            {"after_round": len(self.history), "shares": plan.shares, "speeds": self.speeds, "excluded": plan.excluded},
        )
        self.view.log(plan_table(plan, self.speeds, f"re-planned after round {len(self.history)}"))
        for rank, reason in plan.excluded.items():
            if rank not in self._reported_exclusions:
                self._reported_exclusions.add(rank)
                self.view.log(f"note: worker {rank} slows this job down ({reason}); consider running without it")

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


def plan_table(plan: Plan, speeds: list[float], title: str) -> str:
    """The plan as a small text table: one row per worker."""
    lines = [
        f"{title}: predicted {plan.predicted_samples_per_s:,.0f} samples/s",
        "  worker  share  micro x accum  measured samples/s",
    ]
    for i, share in enumerate(plan.shares):
        lines.append(
            f"  {i:>6}  {share:>5}  {plan.micro_batches[i]:>5} x {plan.accumulation[i]:<5}  {speeds[i]:>18,.0f}"
        )
    return "\n".join(lines)
