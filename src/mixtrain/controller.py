"""Between rounds: pace the rounds, evaluate, record. Workers do the steps; this decides what comes next."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mixtrain._constants import COLLECTIVE_TIMEOUT_S, ROUND_TARGET_S, ROUND_TIMEOUT_S, env_float
from mixtrain.data import steps_per_epoch
from mixtrain.planner import equal_shares
from mixtrain.progress import ProgressView
from mixtrain.rounds import RoundPlan, next_round_steps, summarize_round
from mixtrain.runlog import RunLog
from mixtrain.worker_group import WorkerGroup


@dataclass
class EpochPlan:
    num_samples: int
    global_batch: int
    shares: list[int]
    steps_per_round: int | None
    drift_tolerance: float
    num_eval: int


class Controller:
    def __init__(self, group: WorkerGroup, plan: EpochPlan, log: RunLog, view: ProgressView) -> None:
        self.group = group
        self.plan = plan
        self.log = log
        self.view = view
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []

    def run(self, epochs: int) -> None:
        p = self.plan
        num_steps = steps_per_epoch(p.num_samples, p.global_batch)
        round_steps = p.steps_per_round or 2  # a short first round measures the step time
        round_timeout = env_float(ROUND_TIMEOUT_S) + env_float(COLLECTIVE_TIMEOUT_S)
        for epoch in range(epochs):
            step = 0
            while step < num_steps:
                k = min(round_steps, num_steps - step)
                rplan = RoundPlan(epoch, step, k, tuple(p.shares), p.global_batch, p.drift_tolerance)
                t0 = time.perf_counter()
                reports = self.group.call("run_round", rplan, timeout_s=round_timeout)
                record = summarize_round(rplan, reports, time.perf_counter() - t0)
                self.history.append(record)
                self.log.write("round", record)
                self.view.round_done(record)
                if record["rebroadcast"]:
                    self.view.log(f"replicas drifted by {record['drift']:.2e}: rank 0's weights re-broadcast")
                step += k
                round_steps = next_round_steps(record["wall_s"] / k, env_float(ROUND_TARGET_S), p.steps_per_round)
            self._end_epoch(epoch)

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
