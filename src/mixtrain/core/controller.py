"""Between rounds: pace the rounds, evaluate, record. Workers do the steps; this decides what comes next."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray

from mixtrain._constants import (
    COLLECTIVE_TIMEOUT_S,
    EXCLUDE_GAIN,
    REBALANCE_THRESHOLD,
    ROUND_TARGET_S,
    ROUND_TIMEOUT_S,
    env_float,
)
from mixtrain.checkpoint import CheckpointStore
from mixtrain.config import Slowdown
from mixtrain.core.rounds import RoundPlan, next_round_steps, summarize_round
from mixtrain.core.worker_group import WorkerError, WorkerGroup
from mixtrain.data.sampling import steps_per_epoch
from mixtrain.observe.progress import ProgressView, worker_label
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.planner import (
    Plan,
    equal_shares,
    largest_remainder,
    make_plan,
    micro_batches,
    needs_rebalance,
    plan_record,
    plan_table,
)

EXCLUDE_ROUNDS = 2
"""Measured rounds in a row that must find a worker slowing the job down before it is left out."""
LOST_GRACE_S = 15.0
"""After a worker fails, the others get the collective timeout plus this long to report before they count as lost."""
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


class TrainingStopped(RuntimeError):
    """Training cannot go on (failure budget spent, no worker left, NaN/Inf steps in a row); the message
    names the cause and the checkpoint to resume from."""


class Controller:
    def __init__(
        self,
        group: WorkerGroup,
        plan: EpochPlan,
        log: RunLog,
        view: ProgressView,
        workers: list[dict[str, Any]],
        regroup: Callable[[list[int], bool, bool], None] | None = None,
        admit: Callable[[], list[tuple[dict[str, Any], dict[str, Any]]]] | None = None,
        checkpoints: CheckpointStore | None = None,
        checkpoint_every_s: float = 60.0,
        max_failures: int = 3,
        max_nonfinite_steps: int = 10,
    ) -> None:
        """`regroup(ranks, rollback, lost)` stops those workers and re-forms the group with the rest
        (renumbered); with `rollback` the others first return to the start of the failed round; `lost`
        workers may be replaced. `admit()` brings in replacements that are ready (between rounds)."""
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
        self.admit = admit
        self._reported_exclusions: set[int] = set()
        self._votes, self._vote_rank = 0, -1  # measured rounds in a row that would leave out _vote_rank
        self.checkpoints = checkpoints
        self.checkpoint_every_s = checkpoint_every_s
        self.last_checkpoint: Path | None = None
        self._checkpointed_at = time.monotonic()
        self.num_steps = steps_per_epoch(plan.num_samples, plan.global_batch)
        self.max_failures = max_failures
        self.failures = 0
        self.epochs = 0  # set by run()
        self.max_nonfinite_steps = max_nonfinite_steps
        self._nonfinite_streak = 0
        self._culprits: dict[int, int] = {}  # rank -> first step of the current streak with a NaN/Inf loss

    def run(self, epochs: int, start: tuple[int, int] = (0, 0)) -> None:
        """Train until `epochs` epochs are done, starting at (epoch, step) `start` (a resumed run)."""
        p = self.plan
        num_steps = self.num_steps
        round_steps = p.steps_per_round or 2  # a short first round measures the step time
        round_timeout = env_float(ROUND_TIMEOUT_S) + env_float(COLLECTIVE_TIMEOUT_S)
        grace = env_float(COLLECTIVE_TIMEOUT_S) + LOST_GRACE_S
        self._checkpointed_at = time.monotonic()
        self.epochs = epochs
        for epoch in range(start[0], epochs):
            step = start[1] if epoch == start[0] else 0
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
                reports, lost = self.group.call_tolerant("run_round", rplan, timeout_s=round_timeout, grace_s=grace)
                if lost or any(r.peer_lost for r in reports.values()):
                    self._recover(lost, reports, epoch, step)
                    continue  # the same steps again, with the workers that are left
                record = summarize_round(rplan, list(reports.values()), time.perf_counter() - t0)
                for entry, info in zip(record["workers"], self.workers):  # who, for the report and progress rows
                    entry.update(worker=worker_label(info), device=info["device"], device_name=info["device_name"])
                    entry["host"] = info.get("hostname") or info["host"]
                self.history.append(record)
                self.log.write("round", record)
                self.view.round_done(record)
                if record["rebroadcast"]:
                    self.view.log(f"replicas drifted by {record['drift']:.2e}: rank 0's weights re-broadcast")
                step += k
                self._check_nonfinite(record)
                if len(self.history) > 1:  # the first round is warm-up (allocations, caches), not a measurement
                    self._measure(record)
                    if p.balanced:
                        self._rebalance(record)
                round_steps = next_round_steps(record["wall_s"] / k, env_float(ROUND_TARGET_S), p.steps_per_round)
                if step < num_steps and self._checkpoint_due():
                    self._checkpoint(epoch, step)
                if self.admit is not None and self.failures:
                    self._admit(epoch, step)
            self._end_epoch(epoch)
            if self.checkpoints is not None:
                self._checkpoint(epoch + 1, 0)  # every epoch end, the last one included

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
        assert self.regroup is not None
        info = self.workers[rank]
        self.regroup([rank], False, False)
        self.log.write("left_out", {"after_round": len(self.history), "worker": info, "reason": reason})
        self.view.log(f"left out worker {rank} ({info['device_name']} on {info['host']}): {reason}")
        self._forget([rank])
        self._adopt(self._replan(), f"re-planned without worker {rank} after round {len(self.history)}")

    def _forget(self, ranks: list[int]) -> None:
        """Drop what the controller knows of workers that are gone; the rest are renumbered like the group."""
        for rank in sorted(ranks, reverse=True):
            for seq in (self.workers, self.speeds, self.plan.max_micro_batch, self.shares):
                if seq:
                    del seq[rank]
            self.plan.slowdown = {r - (r > rank): v for r, v in self.plan.slowdown.items() if r != rank}
        self._votes, self._vote_rank, self._reported_exclusions = 0, -1, set()

    def _replan(self) -> Plan:
        """Shares for the workers that are left: by measured speed when balancing, else the old split rescaled."""
        b = self.plan.global_batch
        caps = self.plan.max_micro_batch
        if self.plan.balanced and self.speeds:
            return make_plan(self.speeds, b, memory_caps=caps)
        shares = largest_remainder([float(s) for s in self.shares], b)
        return make_plan(self.speeds or [1.0] * len(shares), b, shares=shares, memory_caps=caps)

    # ---- faults ------------------------------------------------------------------------------
    def _recover(
        self, lost: dict[int, str], reports: dict[int, Any], epoch: int, step: int, in_round: bool = True
    ) -> None:
        """A worker died, stopped answering, or a collective failed: the survivors roll back to the start of
        the round (`in_round`; between rounds their state is already consistent), re-form the group without
        the lost workers, and the round runs again. Nothing before the round is lost, and no sample is
        skipped or used twice."""
        self.failures += 1
        for rank, why in sorted(lost.items()):
            info = self.workers[rank]
            self.view.log(f"worker {rank} ({info['device_name']} on {info['host']}) lost: {why}")
        self.log.write(
            "failure",
            {
                "epoch": epoch,
                "step": step,
                "failures": self.failures,
                "lost": [{"worker": self.workers[r], "reason": why} for r, why in sorted(lost.items())],
                "peer_errors": {r: rep.peer_lost for r, rep in reports.items() if rep.peer_lost},
            },
        )
        left = self.group.num_workers - len(lost)
        if left == 0 or self.failures > self.max_failures or self.regroup is None:
            why = "no worker is left" if left == 0 else f"{self.failures} failures, max_failures={self.max_failures}"
            raise TrainingStopped(f"training stopped at epoch {epoch}, step {step}: {why}. {self._resume_hint()}")
        self.regroup(sorted(lost), in_round, True)
        self._forget(sorted(lost))
        self._adopt(self._replan(), f"re-formed with {left} workers")
        self.view.log(
            f"failure {self.failures} of at most {self.max_failures}: continuing from epoch {epoch}, step {step}"
        )

    def _admit(self, epoch: int, step: int) -> None:
        """Replacements that are ready join between rounds, with rank 0's current state."""
        assert self.admit is not None
        joined = self.admit()
        if not joined:
            return
        for info, probe in joined:
            self.workers.append(info)
            if self.speeds is not None:
                self.speeds.append(probe["samples_per_s"])
            if self.plan.max_micro_batch is not None:
                self.plan.max_micro_batch.append(probe["memory_cap"])
            self.shares.append(max(1, self.plan.global_batch // len(self.workers)))
            self.log.write("rejoined", {"epoch": epoch, "step": step, "worker": info})
            self.view.log(f"worker {info['rank']} ({info['device_name']} on {info['host']}) joined at step {step}")
        self._adopt(self._replan(), f"re-formed with {len(self.workers)} workers")

    def _between_rounds(self, method: str, call: Callable[[], Any], epoch: int, step: int) -> Any:
        """`call()` (a checkpoint, an evaluation), surviving a worker lost while it runs: find who is gone,
        re-form the group without them, and call again."""
        while True:
            try:
                return call()
            except WorkerError as exc:
                if not isinstance(exc.__cause__, ray.exceptions.RayActorError):
                    raise
                grace = env_float(COLLECTIVE_TIMEOUT_S) + LOST_GRACE_S
                _, lost = self.group.call_tolerant("info", timeout_s=grace, grace_s=grace)
                if not lost:
                    raise
                self.view.log(f"a worker was lost during {method}()")
                self._recover(lost, {}, epoch, step, in_round=False)

    def _check_nonfinite(self, record: dict[str, Any]) -> None:
        """Count skipped (NaN/Inf) steps in a row; past the limit, stop and name who produced them."""
        skipped = set(record["skipped_steps"])
        for step in range(record["first_step"], record["first_step"] + record["num_steps"]):
            if step not in skipped:
                self._nonfinite_streak, self._culprits = 0, {}
                continue
            self._nonfinite_streak += 1
            for rank, steps in enumerate(record["nonfinite_steps"]):
                if step in steps:
                    self._culprits.setdefault(rank, step)
            if self._nonfinite_streak >= self.max_nonfinite_steps:
                first = step - self._nonfinite_streak + 1
                who = "; ".join(
                    f"worker {r} ({self.workers[r]['device_name']} on {self.workers[r]['host']}, "
                    f"{self.workers[r]['device']}) from step {s}"
                    for r, s in sorted(self._culprits.items())
                )
                raise TrainingStopped(
                    f"training stopped: {self._nonfinite_streak} steps in a row (epoch {record['epoch']}, steps "
                    f"{first}-{step}) had a NaN or Inf gradient and were skipped on every worker. Non-finite loss: "
                    f"{who or 'none (the summed gradients themselves overflowed)'}. {self._resume_hint()}"
                )

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        return self.checkpoints is not None and time.monotonic() - self._checkpointed_at >= self.checkpoint_every_s

    def _checkpoint(self, epoch: int, step: int) -> None:
        """Rank 0's training state and every rank's random streams, to continue at (epoch, step)."""
        assert self.checkpoints is not None
        timeout = env_float(COLLECTIVE_TIMEOUT_S)

        def collect() -> dict[str, Any]:
            state = self.group.call("training_state", timeout_s=timeout, ranks=[0])[0]
            state["rng"] = self.group.call("rng_state", timeout_s=timeout)
            return state

        state = self._between_rounds("checkpoint", collect, epoch, step)
        meta = {
            "epoch": epoch,
            "step": step,
            "global_step": epoch * self.num_steps + step,
            "shares": self.shares,
            "num_workers": self.group.num_workers,
            "workers": [{k: w[k] for k in ("host", "device_name", "precision")} for w in self.workers],
        }
        self.last_checkpoint = self.checkpoints.save(state, meta)
        self._checkpointed_at = time.monotonic()
        self.log.write("checkpoint", {"path": str(self.last_checkpoint), **meta})

    def _resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "No checkpoint was written yet."
        return (
            f"The last checkpoint, {self.last_checkpoint}, is intact; continue with "
            f"`mixtrain train --resume {self.last_checkpoint.parent.parent}` or fit(resume=...)."
        )

    def _end_epoch(self, epoch: int) -> None:
        rounds = [r for r in self.history if r["epoch"] == epoch]
        samples = sum(r["samples"] for r in rounds)
        wall = sum(r["wall_s"] for r in rounds)
        line = f"epoch {epoch + 1}/{self.epochs}: loss {rounds[-1]['last_loss']:.4f}  {samples / wall:,.0f} samples/s"
        if self.plan.num_eval:
            ev = self._between_rounds("evaluate", self.evaluate, epoch + 1, 0)
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
