"""Changes of who trains, carried out between rounds: leave a worker out (and take it back, or let it go), recover
from lost workers, halve the micro-batch of one out of memory, go back to the last checkpoint, admit replacements.
Each ends with the shares planned again for the workers that are in. The group port does the Ray side; the
membership records it; this says what happened, in the run log and on the terminal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from mixtrain.driver.balancing import Balancing
from mixtrain.driver.checkpointing import Checkpoints
from mixtrain.driver.states import Position, Train
from mixtrain.group.port import GroupPort, WorkersLost
from mixtrain.observe.progress import ProgressView, plan_line, plan_table
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.decisions import EXCLUDE_ROUNDS, FailureBudget, Stop, replan
from mixtrain.policies.planner import Plan, plan_record
from mixtrain.records.messages import RoundPlan, WorkerReport
from mixtrain.records.rounds import RoundRecord
from mixtrain.records.run_state import RunSettings


class TrainingStopped(RuntimeError):
    """Training cannot go on (failure budget spent, no worker left, NaN/Inf steps in a row); the message
    names the cause and the checkpoint to resume from."""


T = TypeVar("T")


class Changes:
    def __init__(
        self,
        port: GroupPort,
        settings: RunSettings,
        *,
        balancing: Balancing,
        budget: FailureBudget,
        checkpoints: Checkpoints,
        history: list[RoundRecord],
        log: RunLog,
        view: ProgressView,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.port = port
        self.members = port.members
        self.settings = settings
        self.balancing = balancing
        self.budget = budget
        self.checkpoints = checkpoints
        self.history = history
        self.log = log
        self.view = view
        self.clock = clock
        self._reported_exclusions: set[int] = set()

    # ---- shares ---------------------------------------------------------------------------------
    def adopt(self, plan: Plan, title: str) -> None:
        """Train with `plan`'s shares from the next round on, and show it (a worker the plan would leave out is
        named once, not at every re-plan)."""
        before = self.members.shares()
        self.members.set_shares(plan.shares)
        self.log.write("plan", {"after_round": len(self.history), **plan_record(plan)})
        excluded = {r: why for r, why in plan.excluded.items() if r not in self._reported_exclusions}
        self._reported_exclusions.update(excluded)
        shown = replace(plan, excluded=excluded)
        if self.settings.plan_tables or len(before) != len(plan.shares):  # a group that changed: the whole table
            self.view.log(plan_table(shown, self.members.infos(), title))
        else:
            self.view.log(plan_line(shown, before, title))

    def replan(self, title: str) -> None:
        """Shares for the workers that are in now (one left, one joined)."""
        plan = replan(
            speeds=self.members.speeds(),
            shares=self.members.shares(),
            global_batch=self.settings.global_batch,
            memory_caps=self.members.memory_caps(),
            balanced=self.settings.balanced,
        )
        self.adopt(plan, title)

    def _renumbered(self) -> None:
        self.balancing.forget()
        self._reported_exclusions = set()

    # ---- leaving out by measurement, and taking back ------------------------------------------
    def leave_out(self, rank: int, reason: str) -> None:
        """Between rounds every replica holds the same state, so the others re-form the group and go on: nothing
        is lost and the epoch's sample order is unchanged (only the split of each batch is). The worker is parked,
        not stopped: the wall clock then checks the call (Balancing.check)."""
        member = self.members[rank]
        recent = self.history[-EXCLUDE_ROUNDS:]
        self.port.leave_out([rank], park=True)
        self.balancing.left_out(sum(r.samples_per_s for r in recent) / len(recent))
        self.log.write("left_out", {"after_round": len(self.history), "worker": member.info, "reason": reason})
        self.view.log(f"left out {member.describe(rank)}: {reason}")
        self._renumbered()
        self.replan(f"re-planned without worker {rank} after round {len(self.history)}")

    def confirm_leave_out(self) -> None:
        """The job is faster without the parked worker, by the wall clock: its device is freed."""
        check, parked = self.balancing.check, self.members.parked
        assert check is not None and parked is not None
        self.port.release_parked()
        self.balancing.check_ended(readmitted=False)
        reason = f"without it the job ran {check.rate:,.0f} samples/s, with it {check.pair_rate:,.0f}"
        self.log.write(
            "leave_out_confirmed", {"after_round": len(self.history), "worker": parked.info, "reason": reason}
        )
        self.view.log(f"leaving out {parked.describe()} confirmed: {reason}")

    def readmit(self, reason: str) -> None:
        """The worker left out mid-run rejoins with the current state; nobody is left out for a while."""
        member = self.port.readmit()
        others = [m.speed for m in self.members if m is not member and m.speed is not None]
        if member.speed is None and others:
            member.speed = min(others)
        member.share = max(1, self.settings.global_batch // len(self.members))
        self.balancing.check_ended(readmitted=True)
        self.log.write("readmitted", {"after_round": len(self.history), "worker": member.info, "reason": reason})
        self.view.log(f"took back {member.describe()}: {reason}")
        self.replan(f"re-formed with {len(self.members)} workers after round {len(self.history)}")

    # ---- faults ---------------------------------------------------------------------------------
    def recover(
        self,
        lost: dict[int, str],
        reports: dict[int, WorkerReport],
        at: Position,
        committed: dict[int, int] | None = None,
    ) -> Position:
        """A worker died, stopped answering, or a collective failed. In a round (`committed`: each survivor's
        committed steps) the survivors go back to their last committed step and those behind take the most
        advanced one's state; between rounds their state is already the same. The group re-forms without the
        lost workers and training goes on at `at`: no committed step is lost, and no sample is skipped or used
        twice. Returns where training continues: `at`, or the last checkpoint when a sharded optimizer lost a
        slice. Raises TrainingStopped when the failure budget is spent."""
        for rank, why in sorted(lost.items()):
            self.view.log(f"{self.members[rank].describe(rank)} lost: {why}")
        left = len(self.members) - len(lost)
        decision = self.budget.record(left, self.clock())
        self.log.write(
            "failure",
            {
                "epoch": at[0],
                "step": at[1],
                "failures": self.budget.failures,
                "lost": [{"worker": self.members[r].info, "reason": why} for r, why in sorted(lost.items())],
                "peer_errors": {r: rep.peer_lost for r, rep in reports.items() if rep.peer_lost},
            },
        )
        if isinstance(decision, Stop):
            raise TrainingStopped(
                f"training stopped at epoch {at[0]}, step {at[1]}: {decision.reason}. "
                f"{self.checkpoints.resume_hint(self.port.scaling)}"
            )
        if self.port.shards_optimizer:
            return self.rewind(sorted(lost))
        self.port.leave_out(sorted(lost), recover=committed, lost=True)
        if self.settings.rejoin:
            self.port.start_replacements()
        self._renumbered()
        self.replan(f"re-formed with {left} workers")
        self.view.log(f"{self.budget.count()}: continuing from epoch {at[0]}, step {at[1]}")
        return at

    def surviving(self, what: str, call: Callable[[], T], at: Position) -> T | Train:
        """`call()` (a checkpoint, an evaluation), surviving workers lost while it runs: re-form the group without
        them and call again; or, when the recovery went back to the last checkpoint, where training goes on."""
        while True:
            try:
                return call()
            except WorkersLost as exc:
                self.view.log(f"a worker was lost during {what}()")
                where = self.recover(exc.lost, {}, at)
            if where != at:
                return Train(*where)

    def rewind(self, lost: Sequence[int]) -> Position:
        """A sharded optimizer's slice died with its worker (or a step was half applied): every worker that is
        left loads the last checkpoint, which always exists (a sharded run writes one first), and training goes
        on from there. Costs the steps since that checkpoint, never the math."""
        state, meta = self.checkpoints.read_last()
        for record in self.history:  # rounds to be trained again: kept in the history, not counted twice
            if (record.epoch, record.first_step) >= (meta.epoch, meta.step):
                record.superseded = True
        self.port.leave_out(lost, lost=True, restore=state)
        self._renumbered()
        self.replan(f"re-formed with {len(self.members)} workers")
        self.log.write("rewound", {"to": str(self.checkpoints.last), "epoch": meta.epoch, "step": meta.step})
        self.view.log(
            f"{self.budget.count()}: the optimizer slice of the lost worker is gone; continuing from the last "
            f"checkpoint {self.checkpoints.last} (epoch {meta.epoch}, step {meta.step})"
        )
        self.view.start_at(meta.epoch * self.settings.num_samples + meta.step * self.settings.global_batch)
        return meta.epoch, meta.step

    def out_of_memory(self, ranks: list[int], plan: RoundPlan, committed: dict[int, int], step: int) -> None:
        """Workers that ran out of device memory mid-round (a probe too optimistic, another process taking
        memory): the round goes on from the committed steps with their micro-batch halved (gradient
        accumulation keeps the math); one out of memory even at a micro-batch of 1 is left out, with the reason.
        Not a failure: nobody was lost, and the halving ends."""
        gone = []
        for rank in ranks:
            member = self.members[rank]
            micro = plan.micro_batches[rank] if plan.micro_batches else member.share
            if micro <= 1:
                gone.append(rank)
                self.view.log(f"left out {member.describe(rank)}: out of memory even at a micro-batch of 1")
                self.log.write("left_out", {"worker": member.info, "reason": "out of memory at micro-batch 1"})
                continue
            member.memory_cap = micro // 2
            self.view.log(
                f"{member.describe(rank)} ran out of memory at micro-batch {micro}: {micro // 2} from now on "
                f"(step {step})"
            )
        self.log.write("out_of_memory", {"ranks": ranks, "step": step, "memory_caps": self.members.memory_caps()})
        self.port.leave_out(gone, recover=committed)
        if gone:
            self._renumbered()
            self.replan(f"re-formed with {len(self.members)} workers")

    def admit(self, at: Position) -> None:
        """Replacements that are ready join between rounds, with rank 0's current state."""
        joined = self.port.admit(self.settings.global_batch)
        for note in joined.refused:
            self.view.log(note)
            self.log.write("replacement_refused", {"epoch": at[0], "step": at[1], "reason": note})
        if not joined.members:
            return
        for member in joined.members:
            member.share = max(1, self.settings.global_batch // len(self.members))
            self.log.write("rejoined", {"epoch": at[0], "step": at[1], "worker": member.info})
            self.view.log(f"{member.describe()} joined at step {at[1]}")
        self._renumbered()
        self.replan(f"re-formed with {len(self.members)} workers")
