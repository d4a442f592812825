"""After each measured round: each worker's speed, and what the shares should be. Reads the round's record and
the membership, asks the policies (policies/decisions.py), and returns their decision; the controller carries it
out. No Ray, no clock."""

from __future__ import annotations

from mixtrain.group.membership import Membership
from mixtrain.policies.decisions import (
    COOLDOWN_ROUNDS,
    Decision,
    LeaveOutCheck,
    Noop,
    Readmit,
    Rebalancer,
    smooth_speeds,
)
from mixtrain.records.rounds import RoundRecord


class Balancing:
    """Speeds smoothed over rounds, the rebalancer's verdicts, and the wall-clock check of a worker left out."""

    def __init__(self, members: Membership, rebalancer: Rebalancer, *, balanced: bool) -> None:
        self.members = members
        self.rebalancer = rebalancer
        self.balanced = balanced
        self.comm_s = 0.0
        """Communication per step, measured in the last round."""
        self.check: LeaveOutCheck | None = None
        """While a worker left out mid-run is parked: whether the job is faster without it."""

    def measure(self, record: RoundRecord) -> None:
        """Each worker's compute speed and the step's communication, from a measured round."""
        new = [w.samples / w.compute_s if w.compute_s > 0 else 0.0 for w in record.workers]
        self.comm_s = max(w.comm_s for w in record.workers) / record.num_steps
        self.members.set_speeds(smooth_speeds(self.members.speeds(), new))

    def decide(self, record: RoundRecord, remaining_samples: int | None = None, reform_s: float = 0.0) -> Decision:
        """What the shares should do after this round: Adopt a plan, LeaveOut a worker, Readmit the parked one
        (while a leave-out is checked), or Noop. `reform_s`: what forming the group last took (the price of a
        leave-out, weighed against what it saves over the `remaining_samples`)."""
        if self.check is not None:
            decision = self.check.observe(record.samples_per_s)
            return decision if isinstance(decision, Readmit) else Noop()
        if not self.balanced:
            return Noop()
        speeds = self.members.speeds()
        assert speeds is not None, "measured rounds set every speed"
        return self.rebalancer.decide(
            speeds=speeds,
            step_compute_s=[w.compute_s / record.num_steps for w in record.workers],
            shares=self.members.shares(),
            memory_caps=self.members.memory_caps(),
            comm_s=self.comm_s,
            measured_rate=record.samples_per_s,
            alone_speeds=self._alone_speeds(record),
            remaining_s=remaining_samples / record.samples_per_s
            if remaining_samples is not None and record.samples_per_s > 0
            else None,
            reform_s=reform_s,
        )

    @property
    def confirmed(self) -> bool:
        """The wall clock confirmed the leave-out being checked: the parked worker may go for good."""
        return self.check is not None and self.check.done

    def left_out(self, pair_rate: float) -> None:
        """A worker was just parked; check the call against what the job did with it (`pair_rate`)."""
        self.check = LeaveOutCheck(pair_rate)

    def check_ended(self, *, readmitted: bool) -> None:
        self.check = None
        if readmitted:
            self.rebalancer.hold(COOLDOWN_ROUNDS)  # no flapping: nobody is left out again for a while

    def forget(self) -> None:
        """The workers were renumbered: votes about a rank mean nothing any more."""
        self.rebalancer.reset()

    def _alone_speeds(self, record: RoundRecord) -> list[float] | None:
        """Where every worker is a CPU worker on one machine: each one's speed with a core whenever it can run,
        its compute time less what its forward and backward spent waiting for a core (a busy machine makes each
        wait; the one left alone gets the cores the other held). Time asleep or reading files is not waiting for
        a core, so it is not taken off. None otherwise: leaving a worker out frees nothing for the rest. An
        estimate; the wall clock checks any call made on it (LeaveOutCheck)."""
        speeds = self.members.speeds()
        if len({i.host for i in self.members.infos()}) != 1 or speeds is None:
            return None
        if any(w.cpu_share is None or w.compute_s <= 0 for w in record.workers):
            return None
        return [
            speed * w.compute_s / max(w.compute_s - w.cpu_wait_s, 1e-3 * w.compute_s)
            for speed, w in zip(speeds, record.workers)
        ]
