"""Between rounds: pace the rounds, evaluate, record. Workers do the steps, the policies decide what comes
next (policies/decisions.py), this carries the decisions out."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import ray

from mixtrain._constants import (
    COLLECTIVE_TIMEOUT_S,
    EXCLUDE_GAIN,
    FAILURE_WINDOW_S,
    LOST_GRACE_S,
    REBALANCE_THRESHOLD,
    ROUND_TARGET_S,
    ROUND_TIMEOUT_S,
    env_float,
)
from mixtrain.checkpoint import CheckpointMeta, CheckpointStore
from mixtrain.comm.state_transfer import pack, unpack
from mixtrain.core import evaluation
from mixtrain.core.checkpointing import save_making_room
from mixtrain.core.group_ops import GroupOps
from mixtrain.core.interrupt import GracefulStop, TrainingInterrupted
from mixtrain.core.messages import RoundPlan
from mixtrain.core.rounds import next_round_steps, summarize_round, whole_exchanges
from mixtrain.core.run_state import Parked, Roster, RunSettings
from mixtrain.core.worker_group import WorkerError, WorkerGroup, WorkerTimeout
from mixtrain.data.sampling import steps_per_epoch
from mixtrain.observe.progress import ProgressView, plan_table, state_memory_line
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import (
    COOLDOWN_ROUNDS,
    EXCLUDE_ROUNDS,
    Adopt,
    FailureBudget,
    LeaveOut,
    LeaveOutCheck,
    NonFiniteStreak,
    Readmit,
    Rebalancer,
    Stop,
    replan,
    smooth_speeds,
)
from mixtrain.policies.planner import Plan, equal_shares, micro_batches, plan_record

RAMP_FIRST_S = 0.2
"""Length of the first measured round; each next one doubles, up to MIXTRAIN_ROUND_TARGET_S."""


class _Rewind(Exception):
    """Training continues from the last checkpoint at (epoch, step): a sharded optimizer lost a slice."""

    def __init__(self, epoch: int, step: int) -> None:
        super().__init__(f"back to epoch {epoch}, step {step}")
        self.epoch, self.step = epoch, step


class TrainingStopped(RuntimeError):
    """Training cannot go on (failure budget spent, no worker left, NaN/Inf steps in a row); the message
    names the cause and the checkpoint to resume from."""


class Controller:
    def __init__(
        self,
        group: WorkerGroup,
        ops: GroupOps,
        settings: RunSettings,
        roster: Roster,
        *,
        log: RunLog,
        view: ProgressView,
        checkpoints: CheckpointStore | None = None,
    ) -> None:
        self.group = group
        self.ops = ops
        self.settings = settings
        self.roster = roster
        self.log = log
        self.view = view
        self.checkpoints = checkpoints
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.comm_s = 0.0  # communication per step, measured in the last round
        self.rebalancer = Rebalancer(
            global_batch=settings.global_batch,
            leave_out_slow=settings.leave_out_slow,
            threshold=env_float(REBALANCE_THRESHOLD),
            min_gain=env_float(EXCLUDE_GAIN),
        )
        self.budget = FailureBudget(settings.max_failures, env_float(FAILURE_WINDOW_S))
        self.nonfinite = NonFiniteStreak(settings.max_nonfinite_steps)
        self._reported_exclusions: set[int] = set()
        self.stop: GracefulStop | None = None
        """Set by the trainer: Ctrl-C / SIGTERM asks for a stop at the next round boundary."""
        self._checkpoint_at: tuple[int, int] | None = None
        self._parked: Parked | None = None
        self._leave_out_check: LeaveOutCheck | None = None
        self.last_checkpoint: Path | None = None
        self._checkpointed_at = time.monotonic()
        self.num_steps = steps_per_epoch(settings.num_samples, settings.global_batch)
        self.epochs = 0  # set by run()
        self.started_at = 0.0
        """time.perf_counter() when run() began: the first step."""

    def run(self, epochs: int, start: tuple[int, int] = (0, 0)) -> None:
        """Train until `epochs` epochs are done, starting at (epoch, step) `start` (a resumed run)."""
        self._checkpointed_at = time.monotonic()
        self.started_at = time.perf_counter()
        self.epochs = epochs
        # a short first round measures the step time (local SGD: H steps, the shortest without an early exchange)
        first = self.settings.steps_per_round or max(2, self.settings.min_round_steps)
        round_steps = whole_exchanges(first, self.settings.steps_per_exchange)
        epoch, step = start
        if self.ops.shards_optimizer and self.checkpoints is not None:
            self._checkpoint(epoch, step)  # a lost worker takes its optimizer slice along: this is the way back
        while epoch < epochs:
            try:
                if self.stop is not None and self.stop.requested:
                    self._stop_here(epoch, step)
                if step < self.num_steps:
                    rplan = self._round_plan(epoch, step, min(round_steps, self.num_steps - step))
                    done = self._round(rplan)
                    step += done
                    if done == rplan.num_steps:
                        round_steps = self._between_rounds(rplan, epoch, step)
                    # else a worker was lost: the rest of the round again, with the workers that are left
                    continue
                if self._epoch_checkpoint_due(epoch):
                    self._checkpoint(epoch + 1, 0)
                self._end_epoch(epoch)
                epoch, step = epoch + 1, 0
            except _Rewind as back:
                epoch, step = back.epoch, back.step

    def _round_plan(self, epoch: int, step: int, num_steps: int) -> RoundPlan:
        r = self.roster
        return RoundPlan(
            epoch=epoch,
            first_step=step,
            num_steps=num_steps,
            shares=tuple(r.shares),
            global_batch=self.settings.global_batch,
            drift_tolerance=self.settings.drift_tolerance,
            micro_batches=tuple(micro_batches(r.shares, r.memory_caps)),
            slowdown=self._slowdown(len(self.history)),
        )

    def _round(self, rplan: RoundPlan) -> int:
        """Run one round on every worker and record it. Returns the steps done: all of them, or after a lost
        worker (recovered already) the steps every survivor now holds, which may be none."""
        collective_s = env_float(COLLECTIVE_TIMEOUT_S)
        t0 = time.perf_counter()
        reports, lost = self.group.call_tolerant(
            "run_round",
            rplan,
            timeout_s=env_float(ROUND_TIMEOUT_S) + collective_s,
            grace_s=collective_s + env_float(LOST_GRACE_S),
            peer_grace_s=env_float(LOST_GRACE_S),
        )
        wall_s = time.perf_counter() - t0
        if lost or any(rep.peer_lost for rep in reports.values()):
            committed = {r: rep.committed_steps for r, rep in reports.items()}
            kept = max(committed.values(), default=0)
            if kept:
                partial = (kept, self._samples(rplan, kept))
                self._record(summarize_round(rplan, list(reports.values()), wall_s, partial), sorted(reports))
            out_of_memory = sorted(r for r, rep in reports.items() if rep.out_of_memory)
            if out_of_memory and not lost:
                self._out_of_memory(out_of_memory, rplan, committed, rplan.first_step + kept)
            else:
                self._recover(lost, reports, rplan.epoch, rplan.first_step + kept, committed=committed)
            return kept
        self._record(summarize_round(rplan, list(reports.values()), wall_s), sorted(reports))
        return rplan.num_steps

    def _samples(self, rplan: RoundPlan, num_steps: int) -> int:
        """Training samples in `num_steps` steps from the round's first (the epoch's last step may be short)."""
        first, batch = rplan.first_step, self.settings.global_batch
        return sum(min(batch, self.settings.num_samples - t * batch) for t in range(first, first + num_steps))

    def _record(self, record: dict[str, Any], ranks: list[int]) -> None:
        for entry, rank in zip(record["workers"], ranks):  # who, for the report and progress rows
            info = self.roster.workers[rank]
            entry.update(worker=info.label(), device=info.device, device_name=info.device_name)
            entry["host"] = info.hostname or info.host
        self.history.append(record)
        self.log.write("round", record)
        self.view.round_done(record)
        if record["rebroadcast"]:
            self.view.log(f"replicas drifted by {record['drift']:.2e}: rank 0's weights re-broadcast")

    def _between_rounds(self, done: RoundPlan, epoch: int, step: int) -> int:
        """After a good round: the NaN streak, pacing and shares, a checkpoint when due, replacements.
        Returns the number of steps for the next round."""
        record = self.history[-1]
        self._check_nonfinite(record)
        if len(self.history) == 1:  # the optimizer state exists now: say what each replica holds
            self.view.log(state_memory_line(record))
        if len(self.history) > 1:  # the first round is warm-up (allocations, caches), not a measurement
            self._measure(record)
            if self._leave_out_check is not None:
                self._check_leave_out(record)
            elif self.settings.balanced:
                self._rebalance(record)
        if step < self.num_steps and self._checkpoint_due():
            self._checkpoint(epoch, step)
        if self.settings.rejoin and self.budget.failures:
            self._admit(epoch, step)
        # Rounds start short and double up to the target: the first decisions (shares, leaving a worker out,
        # checking that call) come within a second or two instead of after several full rounds.
        target = min(env_float(ROUND_TARGET_S), RAMP_FIRST_S * 2 ** (len(self.history) - 1))
        return next_round_steps(
            record["wall_s"] / done.num_steps,
            target,
            self.settings.steps_per_round,
            per_exchange=self.settings.steps_per_exchange,
            min_steps=self.settings.min_round_steps,
        )

    def _slowdown(self, round_index: int) -> tuple[float, ...]:
        table = self.roster.slowdown
        if not table:
            return ()
        n = len(self.roster.shares)
        return tuple(table[r][0] if r in table and round_index >= table[r][1] else 1.0 for r in range(n))

    def _measure(self, record: dict[str, Any]) -> None:
        new = [w["samples"] / w["compute_s"] if w["compute_s"] > 0 else 0.0 for w in record["workers"]]
        self.comm_s = max(w["comm_s"] for w in record["workers"]) / record["num_steps"]
        self.roster.speeds = smooth_speeds(self.roster.speeds, new)

    def _alone_speeds(self, record: dict[str, Any]) -> list[float] | None:
        """Where every worker is a CPU worker on one machine: each one's speed with a core whenever it can run,
        its compute time less what its forward and backward spent waiting for a core (a busy machine makes each
        wait; the one left alone gets the cores the other held). Time asleep or reading files is not waiting for
        a core, so it is not taken off. None otherwise: leaving a worker out frees nothing for the rest. An
        estimate; the wall clock checks any call made on it (LeaveOutCheck)."""
        workers = record["workers"]
        speeds = self.roster.speeds
        if len({w.host for w in self.roster.workers}) != 1 or speeds is None:
            return None
        if any(w.get("cpu_share") is None or w["compute_s"] <= 0 for w in workers):
            return None
        return [
            speed * w["compute_s"] / max(w["compute_s"] - w["cpu_wait_s"], 1e-3 * w["compute_s"])
            for speed, w in zip(speeds, workers)
        ]

    def _rebalance(self, record: dict[str, Any]) -> None:
        r = self.roster
        assert r.speeds is not None
        decision = self.rebalancer.decide(
            speeds=r.speeds,
            step_compute_s=[w["compute_s"] / record["num_steps"] for w in record["workers"]],
            shares=r.shares,
            memory_caps=r.memory_caps,
            comm_s=self.comm_s,
            measured_rate=record["samples_per_s"],
            alone_speeds=self._alone_speeds(record),
        )
        if isinstance(decision, LeaveOut):
            self._leave_out(decision.rank, decision.reason)
        elif isinstance(decision, Adopt):
            self._adopt(decision.plan, f"re-planned after round {len(self.history)}")

    def _adopt(self, plan: Plan, title: str) -> None:
        self.roster.shares = plan.shares
        self.log.write("plan", {"after_round": len(self.history), **plan_record(plan)})
        excluded = {r: why for r, why in plan.excluded.items() if r not in self._reported_exclusions}
        self._reported_exclusions.update(excluded)
        shown = replace(plan, excluded=excluded)  # a worker that slows the job is named once, not every re-plan
        self.view.log(plan_table(shown, self.roster.workers, title))

    def _leave_out(self, rank: int, reason: str) -> None:
        """Between rounds every replica holds the same state, so the others re-form the group and go on:
        nothing is lost and the epoch's sample order is unchanged (only the split of each batch is). The
        worker is parked, not stopped: the wall clock then checks the call (`LeaveOutCheck`)."""
        r = self.roster
        info = r.workers[rank]
        pair_rate = sum(h["samples_per_s"] for h in self.history[-EXCLUDE_ROUNDS:]) / len(
            self.history[-EXCLUDE_ROUNDS:]
        )
        self._parked = Parked(
            info=info,
            speed=r.speeds[rank] if r.speeds else None,
            memory_cap=r.memory_caps[rank],
            slowdown=r.slowdown.get(rank),
        )
        self._leave_out_check = LeaveOutCheck(pair_rate)
        self.ops.leave_out([rank], park=True)
        self.log.write("left_out", {"after_round": len(self.history), "worker": info, "reason": reason})
        self.view.log(f"left out {info.short(rank)}: {reason}")
        self._forget([rank])
        self._adopt(self._replan(), f"re-planned without worker {rank} after round {len(self.history)}")

    def _check_leave_out(self, record: dict[str, Any]) -> None:
        assert self._leave_out_check is not None
        decision = self._leave_out_check.observe(record["samples_per_s"])
        if isinstance(decision, Readmit):
            self._readmit(decision.reason)
        elif self._leave_out_check.done:  # confirmed by the wall clock: free the parked worker's device
            check, parked = self._leave_out_check, self._parked
            assert parked is not None
            self._leave_out_check, self._parked = None, None
            self.ops.release_parked()
            reason = f"without it the job ran {check.rate:,.0f} samples/s, with it {check.pair_rate:,.0f}"
            self.log.write(
                "leave_out_confirmed", {"after_round": len(self.history), "worker": parked.info, "reason": reason}
            )
            self.view.log(f"leaving out {parked.info.short()} confirmed: {reason}")

    def _readmit(self, reason: str) -> None:
        """The worker left out mid-run rejoins with the current state; nobody is left out for a while."""
        parked, r = self._parked, self.roster
        assert parked is not None
        info = self.ops.readmit()
        r.workers.append(info)
        if r.speeds is not None:
            r.speeds.append(parked.speed or min(r.speeds))
        r.memory_caps.append(parked.memory_cap)
        r.shares.append(max(1, self.settings.global_batch // len(r.workers)))
        if parked.slowdown is not None:
            r.slowdown[len(r.workers) - 1] = parked.slowdown
        self._parked, self._leave_out_check = None, None
        self.rebalancer.hold_rounds = COOLDOWN_ROUNDS
        self.log.write("readmitted", {"after_round": len(self.history), "worker": info, "reason": reason})
        self.view.log(f"took back {info.short()}: {reason}")
        self._adopt(self._replan(), f"re-formed with {len(r.workers)} workers after round {len(self.history)}")

    def _forget(self, ranks: list[int]) -> None:
        self.roster.forget(ranks)
        self.rebalancer.reset()
        self._reported_exclusions = set()

    def _replan(self) -> Plan:
        r = self.roster
        return replan(
            speeds=r.speeds,
            shares=r.shares,
            global_batch=self.settings.global_batch,
            memory_caps=r.memory_caps,
            balanced=self.settings.balanced,
        )

    # ---- faults ------------------------------------------------------------------------------
    def _recover(
        self,
        lost: dict[int, str],
        reports: dict[int, Any],
        epoch: int,
        step: int,
        committed: dict[int, int] | None = None,
    ) -> None:
        """A worker died, stopped answering, or a collective failed. In a round (`committed`: each survivor's
        committed steps) the survivors go back to their last committed step and those behind take the most
        advanced one's state; between rounds their state is already the same. The group re-forms without the
        lost workers and training goes on at (epoch, `step`): no committed step is lost, and no sample is
        skipped or used twice."""
        workers = self.roster.workers
        for rank, why in sorted(lost.items()):
            self.view.log(f"{workers[rank].short(rank)} lost: {why}")
        left = self.group.num_workers - len(lost)
        decision = self.budget.record(left, time.monotonic())
        self.log.write(
            "failure",
            {
                "epoch": epoch,
                "step": step,
                "failures": self.budget.failures,
                "lost": [{"worker": workers[r], "reason": why} for r, why in sorted(lost.items())],
                "peer_errors": {r: rep.peer_lost for r, rep in reports.items() if rep.peer_lost},
            },
        )
        if isinstance(decision, Stop):
            raise TrainingStopped(
                f"training stopped at epoch {epoch}, step {step}: {decision.reason}. {self._resume_hint()}"
            )
        if self.ops.shards_optimizer:
            self._rewind(sorted(lost))  # raises _Rewind
        self.ops.leave_out(sorted(lost), recover=committed, lost=True)
        if self.settings.rejoin:
            self.ops.start_replacements()
        self._forget(sorted(lost))
        self._adopt(self._replan(), f"re-formed with {left} workers")
        self.view.log(f"{self.budget.count()}: continuing from epoch {epoch}, step {step}")

    def _out_of_memory(self, ranks: list[int], rplan: RoundPlan, committed: dict[int, int], step: int) -> None:
        """Workers that ran out of device memory mid-round (a probe too optimistic, another process taking
        memory): the round goes on from the committed steps with their micro-batch halved (gradient
        accumulation keeps the math); one out of memory even at a micro-batch of 1 is left out, with the reason.
        Not a failure: nobody was lost, and the halving ends."""
        r, gone = self.roster, []
        for rank in ranks:
            micro = rplan.micro_batches[rank] if rplan.micro_batches else r.shares[rank]
            who = r.workers[rank].short(rank)
            if micro <= 1:
                gone.append(rank)
                self.view.log(f"left out {who}: out of memory even at a micro-batch of 1")
                self.log.write("left_out", {"worker": r.workers[rank], "reason": "out of memory at micro-batch 1"})
                continue
            r.memory_caps[rank] = micro // 2
            self.view.log(f"{who} ran out of memory at micro-batch {micro}: {micro // 2} from now on (step {step})")
        self.log.write("out_of_memory", {"ranks": ranks, "step": step, "memory_caps": list(r.memory_caps)})
        self.ops.leave_out(gone, recover=committed)
        if gone:
            self._forget(gone)
            self._adopt(self._replan(), f"re-formed with {len(r.workers)} workers")

    def _rewind(self, lost: list[int]) -> None:
        """A sharded optimizer's slice died with its worker (or a step was half applied): every worker that
        is left loads the last checkpoint, which always exists (run() writes one first), and training goes
        on from there. Costs the steps since that checkpoint, never the math."""
        assert self.checkpoints is not None and self.last_checkpoint is not None, "sharded runs checkpoint first"
        state, manifest = CheckpointStore.read(self.last_checkpoint)
        state.pop("rng", None)
        meta = CheckpointMeta.from_manifest(manifest)
        for record in self.history:  # rounds to be trained again: kept in the history, not counted twice
            if (record["epoch"], record["first_step"]) >= (meta.epoch, meta.step):
                record["superseded"] = True
        self.ops.leave_out(lost, lost=True, restore=ray.put(pack(state)))
        self._forget(lost)
        self._adopt(self._replan(), f"re-formed with {self.group.num_workers} workers")
        self.log.write("rewound", {"to": str(self.last_checkpoint), "epoch": meta.epoch, "step": meta.step})
        self.view.log(
            f"{self.budget.count()}: the optimizer slice of the lost worker is gone; continuing from the last "
            f"checkpoint {self.last_checkpoint} (epoch {meta.epoch}, step {meta.step})"
        )
        self.view.start_at(meta.epoch * self.settings.num_samples + meta.step * self.settings.global_batch)
        raise _Rewind(meta.epoch, meta.step)

    def _admit(self, epoch: int, step: int) -> None:
        """Replacements that are ready join between rounds, with rank 0's current state."""
        joined = self.ops.admit(self.settings.global_batch)
        for note in joined.refused:
            self.view.log(note)
            self.log.write("replacement_refused", {"epoch": epoch, "step": step, "reason": note})
        if not joined.workers:
            return
        r = self.roster
        for info, probe in joined.workers:
            r.workers.append(info)
            if r.speeds is not None:
                r.speeds.append(probe.samples_per_s)
            r.memory_caps.append(probe.memory_cap)
            r.shares.append(max(1, self.settings.global_batch // len(r.workers)))
            self.log.write("rejoined", {"epoch": epoch, "step": step, "worker": info})
            self.view.log(f"{info.short()} joined at step {step}")
        self._adopt(self._replan(), f"re-formed with {len(r.workers)} workers")

    def _tolerant(self, method: str, call: Callable[[], Any], epoch: int, step: int) -> Any:
        """`call()` (a checkpoint, an evaluation), surviving a worker lost while it runs, dead or silent past
        the call's deadline: find who is gone, re-form the group without them, and call again."""
        while True:
            try:
                return call()
            except WorkerTimeout as exc:
                lost = {r: f"did not answer {method}() in time (stopped, asleep or hung)" for r in exc.ranks}
            except WorkerError as exc:
                if not isinstance(exc.__cause__, ray.exceptions.RayActorError):
                    raise
                grace = env_float(COLLECTIVE_TIMEOUT_S) + env_float(LOST_GRACE_S)
                _, lost = self.group.call_tolerant("info", timeout_s=grace, grace_s=grace)
                if not lost:
                    raise
            self.view.log(f"a worker was lost during {method}()")
            self._recover(lost, {}, epoch, step)

    def _check_nonfinite(self, record: dict[str, Any]) -> None:
        """Count skipped (NaN/Inf) steps in a row; past the limit, stop and name who produced them."""
        decision = self.nonfinite.observe(
            epoch=record["epoch"],
            steps=range(record["first_step"], record["first_step"] + record["num_steps"]),
            skipped_steps=record["skipped_steps"],
            nonfinite_steps=record["nonfinite_steps"],
            names=[f"worker {i} ({w.device_name} on {w.host}, {w.device})" for i, w in enumerate(self.roster.workers)],
        )
        if isinstance(decision, Stop):
            raise TrainingStopped(f"training stopped: {decision.reason}. {self._resume_hint()}")

    # ---- checkpoints -------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        elapsed = time.monotonic() - self._checkpointed_at
        return self.checkpoints is not None and elapsed >= self.settings.checkpoint_every_s

    def _epoch_checkpoint_due(self, epoch: int) -> bool:
        """At the end of `epoch`: before an evaluation (a worker lost in it must not cost the epoch), after the
        last epoch (so `--resume --epochs N` goes on from there), and otherwise when one is due by time. Not at
        every epoch end: an epoch of a small data set takes well under a second on a GPU, and a checkpoint of
        every one cost 13% of training in the GPU check's overhead step (80 ms each, 0.6 s epochs)."""
        if self.checkpoints is None:
            return False
        return bool(self.settings.num_eval) or epoch + 1 == self.epochs or self._checkpoint_due()

    def _checkpoint(self, epoch: int, step: int) -> None:
        """Rank 0's training state and every rank's random streams, to continue at (epoch, step)."""
        assert self.checkpoints is not None
        timeout = env_float(COLLECTIVE_TIMEOUT_S)

        def collect() -> dict[str, Any]:
            state = self.ops.full_state(timeout)
            state["rng"] = self.group.call("rng_state", timeout_s=timeout)
            return state

        state = self._tolerant("checkpoint", collect, epoch, step)
        meta = CheckpointMeta(
            epoch=epoch,
            step=step,
            global_step=epoch * self.num_steps + step,
            shares=list(self.roster.shares),
            num_workers=self.group.num_workers,
            workers=[
                {"host": w.host, "device_name": w.device_name, "precision": w.precision} for w in self.roster.workers
            ],
            run_id=self.settings.run_id,
            global_batch=self.settings.global_batch,
            num_samples=self.settings.num_samples,
        )
        path = save_making_room(
            self.checkpoints, unpack(state), asdict(meta), self.log, self.view, self.last_checkpoint
        )
        if path is None:
            return
        self.last_checkpoint = path
        self._checkpoint_at = (epoch, step)
        self._checkpointed_at = time.monotonic()
        self.log.write("checkpoint", {"path": str(self.last_checkpoint), **asdict(meta)})

    def _stop_here(self, epoch: int, step: int) -> None:
        """Ctrl-C: a checkpoint here (unless one was just written here), then stop with the resume command."""
        if self.checkpoints is not None and self._checkpoint_at != (epoch, step):
            self._checkpoint(epoch, step)
        self.log.write("interrupted", {"epoch": epoch, "step": step, "checkpoint": str(self.last_checkpoint)})
        raise TrainingInterrupted(f"stopped at epoch {epoch}, step {step}. {self._resume_hint()}", self.last_checkpoint)

    def _resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "No checkpoint was written yet."
        return (
            f"The last checkpoint, {self.last_checkpoint}, is intact; continue with "
            f"`mixtrain train --resume {self.last_checkpoint.parent.parent}` or fit(resume=...)."
        )

    def _end_epoch(self, epoch: int) -> None:
        rounds = [r for r in self.history if r["epoch"] == epoch and not r.get("superseded")]
        samples = sum(r["samples"] for r in rounds)
        wall = sum(r["wall_s"] for r in rounds)
        line = f"epoch {epoch + 1}/{self.epochs}:"
        if rounds:  # none when a run resumed exactly at this epoch's end (a Ctrl-C after its last round)
            line += f" loss {rounds[-1]['last_loss']:.4f}  {samples / wall:,.0f} samples/s"
        if self.settings.num_eval:
            ev = self._tolerant("evaluate", self.evaluate, epoch + 1, 0)
            ev["epoch"] = epoch
            self.evals.append(ev)
            self.log.write("eval", ev)
            line += f"  held-out loss {ev['loss']:.4f}"
            line += "".join(f"  {k} {v:.4f}" for k, v in ev.items() if k not in ("loss", "samples", "epoch"))
        self.view.log(line)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, each worker taking a contiguous slice of the eval set. The deadline follows the
        slice and the worker's measured speed (a forward pass is cheaper than the training step it was timed
        on), so a worker asleep is found out in about the collective timeout, not in half an hour."""
        sizes = equal_shares(self.settings.num_eval, self.group.num_workers)  # zeros when fewer samples than workers
        bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        speeds = self.roster.speeds or []
        slowest = max((n / v for n, v in zip(sizes, speeds) if v > 0), default=0.0)
        timeout = env_float(COLLECTIVE_TIMEOUT_S) + 2 * slowest if speeds else env_float(ROUND_TIMEOUT_S)
        parts = self.group.call_each("evaluate", bounds, timeout_s=timeout)
        return evaluation.summarize(parts)
