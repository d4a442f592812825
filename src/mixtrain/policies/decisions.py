"""The run's policies as pure objects: each takes measurements and returns a decision; the controller and
the bring-up carry decisions out. No Ray, no I/O, no clock: every case is unit-tested without processes.

- `smooth_speeds`: compute speed per worker, smoothed over rounds, a step change taken at once.
- `Rebalancer`: re-plan shares past an imbalance threshold; leave out a worker that slows the job down
  once `EXCLUDE_ROUNDS` measured rounds in a row say so, by the model (speeds and communication) or by
  what the job measurably did (two workers slower than the faster one computes alone).
- `LeaveOutCheck`: after a worker was left out mid-run, compare the job without it with what it did
  with it, and take it back (`Readmit`) when the call turns out wrong; no new leave-out for a while after.
- `first_plan`: the plan before the first step, and whether a worker should be left out first.
- `replan`: shares for the workers that are left after one is gone or one joins.
- `FailureBudget`: how many lost-worker recoveries a run may make.
- `NonFiniteStreak`: stop after too many NaN/Inf steps in a row, naming who produced them.
- `recovery_source`: after a failed round, whose state the survivors continue from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mixtrain.policies.planner import Plan, largest_remainder, make_plan, needs_rebalance

EXCLUDE_ROUNDS = 2
"""Measured rounds in a row that must find a worker slowing the job down before it is left out."""
MEASURED_MARGIN = 0.10
"""Two workers are left to one when the faster one's compute speed alone beats the pair's measured samples/s
by this fraction: the model missed costs (a loaded machine, communication hidden in compute), the wall
clock did not."""
BUSY_MARGIN = 0.25
"""As MEASURED_MARGIN, where the faster one's speed alone is estimated from the time it waited for a core on a
busy machine (`alone_speeds`): a core's speed does not grow in step with the time it is given (a busy sibling
hyperthread, shared caches), so the estimate must clear a wider margin. 2026-11-25, a CNN beside a busy loop on
a 2-core machine: 300 samples/s on 46% of a core extrapolates to 650; alone it ran 500 (the wall clock took it
back)."""
READMIT_MARGIN = 0.05
"""A worker left out mid-run comes back when the job without it runs this fraction slower than with it."""
COOLDOWN_ROUNDS = 30
"""Rounds after a re-admission in which no worker is left out again (no flapping)."""
STEP_CHANGE = 0.5
"""A measured speed this far (relative) from the smoothed one replaces it instead of being averaged in:
far above round-to-round noise (about 30% for short rounds on a busy machine), far below a 3x throttle."""


@dataclass(frozen=True)
class Noop:
    """Nothing to change."""


@dataclass(frozen=True)
class Adopt:
    """Run with this plan from the next round on."""

    plan: Plan


@dataclass(frozen=True)
class LeaveOut:
    """Stop worker `rank` (its state is the others'; nothing is lost) and re-plan without it."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Readmit:
    """Take back the worker left out on measurement: the job was faster with it."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """Training cannot go on; `reason` says why (the controller adds where to resume from)."""

    reason: str


Decision = Noop | Adopt | LeaveOut | Readmit | Stop


def smooth_speeds(old: Sequence[float] | None, new: Sequence[float]) -> list[float]:
    """Each worker's compute speed, smoothed over rounds; a step change (a laptop starting to throttle)
    is taken at once instead of being averaged in slowly."""
    if old is None:
        return list(new)
    return [cur if o <= 0 or abs(cur - o) / o > STEP_CHANGE else 0.5 * o + 0.5 * cur for o, cur in zip(old, new)]


class Rebalancer:
    """Between rounds, from the measured speeds: leave a worker out, re-plan, or keep the shares.

    Leaving out needs `EXCLUDE_ROUNDS` measured rounds in a row naming the same worker (one noisy round on
    a busy machine must not cost a device); re-planning needs the measured imbalance past `threshold`
    (hysteresis against flapping)."""

    def __init__(
        self, *, global_batch: int, leave_out_slow: bool, threshold: float, min_gain: float, payback_s: float = 0.0
    ) -> None:
        self.global_batch = global_batch
        self.payback_s = payback_s
        """The least price of a leave-out mid-run, in seconds (MIXTRAIN_LEAVE_OUT_PAYBACK_S): re-forming the group
        and its warm-up round (a worker was once left out in the last epoch of a 14-second run). The measured
        price of forming the group (`decide(reform_s=...)`) counts where it is higher; 0 turns the rule off."""
        self.leave_out_slow = leave_out_slow
        self.threshold = threshold
        self.min_gain = min_gain
        self._votes, self._vote_for = 0, ""
        self.hold_rounds = 0
        """Rounds left in which nobody is left out (after a re-admission)."""

    @property
    def voting(self) -> bool:
        """The last decision found a worker to leave out and counted its vote (not yet EXCLUDE_ROUNDS in a row)."""
        return self._votes > 0

    def reset(self) -> None:
        """Forget the vote (the workers were renumbered)."""
        self._votes, self._vote_for = 0, ""

    def hold(self, rounds: int) -> None:
        """Leave nobody out for the next `rounds` rounds (after a worker was taken back: no flapping)."""
        self.hold_rounds = rounds

    def decide(
        self,
        *,
        speeds: Sequence[float],
        step_compute_s: Sequence[float],
        shares: Sequence[int],
        memory_caps: Sequence[int | None] | None,
        comm_s: float,
        measured_rate: float | None = None,
        alone_speeds: Sequence[float] | None = None,
        remaining_s: float | None = None,
        reform_s: float = 0.0,
    ) -> Decision:
        """`measured_rate`: the job's samples/s over the last round, by the wall clock. `alone_speeds`: what each
        worker would compute with the others gone, where that differs from `speeds` (workers that share a busy
        machine: one left alone gets the cores the other held). `remaining_s`: the training left, at the
        measured rate: nobody is left out when what that would save (the predicted speed-up over the training
        left) is under the price of re-forming the group: `reform_s` as measured, at least `payback_s`."""
        plan = make_plan(speeds, self.global_batch, memory_caps=memory_caps, comm_s=comm_s, min_gain=self.min_gain)
        found = self._exclusion(plan, speeds, measured_rate, alone_speeds)
        if found is not None and remaining_s is not None and self.payback_s > 0:
            if saved_s(remaining_s, found[3]) < max(self.payback_s, reform_s):
                found = None  # the end is near: a leave-out would not pay for itself
        self.hold_rounds = max(0, self.hold_rounds - 1)
        if found is not None:
            rank, reason, vote, _ = found
            self._votes = self._votes + 1 if self._vote_for == vote else 1
            self._vote_for = vote
            if self._votes >= EXCLUDE_ROUNDS:
                self.reset()
                return LeaveOut(rank, reason)
        else:
            self.reset()
        if not needs_rebalance(step_compute_s, self.threshold) or plan.shares == list(shares):
            return Noop()
        return Adopt(plan)

    def _exclusion(
        self,
        plan: Plan,
        speeds: Sequence[float],
        measured_rate: float | None,
        alone_speeds: Sequence[float] | None = None,
    ) -> tuple[int, str, str, float] | None:
        """The worker to leave out, why, what the rounds vote on, and how many times faster the job is predicted
        to run without it: that worker, by the model; by the measured pair, that one of the two is faster alone
        (two equal workers on a busy machine trade places as the faster one from round to round: the last round
        names which goes). None to keep everyone."""
        if not self.leave_out_slow or self.hold_rounds > 0:
            return None
        if plan.excluded:
            rank, reason = next(iter(plan.excluded.items()))
            return rank, reason, f"worker {rank}", plan.speedup_without
        if measured_rate is None or len(speeds) != 2:
            return None
        fast = max(range(2), key=lambda i: (speeds[i], -i))
        alone, why = speeds[fast], f"communication and waiting cost more than worker {1 - fast} adds"
        if alone < measured_rate * (1.0 + MEASURED_MARGIN):  # its speed in the pair says keep both
            if alone_speeds is None:
                return None
            fast = max(range(2), key=lambda i: (alone_speeds[i], -i))
            alone = alone_speeds[fast]
            if alone < measured_rate * (1.0 + BUSY_MARGIN):
                return None
            why = (
                f"the two share a busy machine: worker {fast} computes {speeds[fast]:,.0f} samples/s, "
                f"{1 - speeds[fast] / alone:.0%} of that time waiting for a core; the cores worker {1 - fast} "
                "holds would be its own"
            )
        return (
            1 - fast,
            f"measured: the two workers ran {measured_rate:,.0f} samples/s together, while worker {fast} alone "
            f"would compute {alone:,.0f} ({why})",
            "one alone",
            alone / measured_rate,
        )


def saved_s(remaining_s: float, speedup: float) -> float:
    """Seconds a leave-out saves over `remaining_s` of training at today's pace when the job then runs `speedup`
    times faster."""
    return remaining_s * (1.0 - 1.0 / speedup) if speedup > 0 else 0.0


class LeaveOutCheck:
    """After a worker was left out mid-run: the job's measured samples/s without it against what it did with
    it (`pair_rate`). A loaded machine can make the call wrong either way, so the check is the wall clock:
    after a warm-up round, `EXCLUDE_ROUNDS` rounds without it that run at least `READMIT_MARGIN` slower than
    the pair did bring it back (`Readmit`). Rounds at the pair's pace or better end the check."""

    def __init__(self, pair_rate: float) -> None:
        self.pair_rate = pair_rate
        self._rounds: list[float] = []
        self.done = False
        self.rate = 0.0
        """The job's samples/s without the worker over the rounds that decided (set once `done`)."""

    def observe(self, measured_rate: float) -> Decision:
        if self.done:
            return Noop()
        self._rounds.append(measured_rate)
        recent = self._rounds[1:]  # the first round after the change warms up
        if len(recent) < EXCLUDE_ROUNDS:
            return Noop()
        rate = sum(recent[-EXCLUDE_ROUNDS:]) / EXCLUDE_ROUNDS
        if rate < self.pair_rate * (1.0 - READMIT_MARGIN):
            self.done, self.rate = True, rate
            return Readmit(
                f"without it the job ran {rate:,.0f} samples/s, with it {self.pair_rate:,.0f}: taking it back"
            )
        if rate >= self.pair_rate:
            self.done, self.rate = True, rate  # confirmed by the wall clock
        return Noop()


def first_plan(
    *,
    speeds: Sequence[float],
    global_batch: int,
    memory_caps: Sequence[int | None],
    comm_s: float,
    min_gain: float,
    fixed_shares: Sequence[int] | None,
    leave_out_slow: bool,
) -> tuple[Plan, Decision]:
    """The plan before the first step, and LeaveOut when a worker slows the job down and may be left out
    (the bring-up then measures again without it). Fixed shares are never changed."""
    if fixed_shares is not None:
        plan = make_plan(
            speeds, global_batch, shares=fixed_shares, memory_caps=memory_caps, comm_s=comm_s, min_gain=min_gain
        )
        return plan, Noop()
    plan = make_plan(speeds, global_batch, memory_caps=memory_caps, comm_s=comm_s, min_gain=min_gain)
    if plan.excluded and leave_out_slow:
        rank, reason = next(iter(plan.excluded.items()))
        return plan, LeaveOut(rank, reason)
    return plan, Noop()


def replan(
    *,
    speeds: Sequence[float] | None,
    shares: Sequence[int],
    global_batch: int,
    memory_caps: Sequence[int | None] | None,
    balanced: bool,
) -> Plan:
    """Shares for the workers that are left (or with one that joined): by measured speed when balancing,
    else the old split rescaled to the global batch."""
    if balanced and speeds:
        return make_plan(speeds, global_batch, memory_caps=memory_caps)
    rescaled = largest_remainder([float(s) for s in shares], global_batch)
    return make_plan(speeds or [1.0] * len(rescaled), global_batch, shares=rescaled, memory_caps=memory_caps)


class FailureBudget:
    """At most `max_failures` recoveries from lost workers within any `window_s` (an hour by default): a
    laptop whose Wi-Fi stalls three times a day does not end a multi-day run, a worker that keeps dying does."""

    def __init__(self, max_failures: int, window_s: float = 3600.0) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.failures = 0
        """Failures over the whole run."""
        self._times: list[float] = []

    def record(self, workers_left: int, now: float) -> Decision:
        """Count one failure at `now` (seconds, any monotonic clock) that leaves `workers_left` workers."""
        self.failures += 1
        self._times = [t for t in self._times if now - t < self.window_s] + [now]
        if workers_left == 0:
            return Stop("no worker is left")
        if len(self._times) > self.max_failures:
            return Stop(
                f"{len(self._times)} failures within {self.window_s / 60:g} minutes, max_failures={self.max_failures}"
            )
        return Noop()

    @property
    def recent(self) -> int:
        """Failures in the current window (as of the last one)."""
        return len(self._times)

    def count(self) -> str:
        """'failure N of at most M per W minutes': where the run stands, for the line after a recovery."""
        return f"failure {self.recent} of at most {self.max_failures} per {self.window_s / 60:g} minutes"


class NonFiniteStreak:
    """Counts skipped (NaN/Inf) steps in a row across rounds; past the limit, Stop naming who produced
    them. `names[rank]` describes a worker in the message."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.streak = 0
        self._culprits: dict[int, int] = {}  # rank -> first step of the current streak with a NaN/Inf loss
        self._first = (0, 0)  # (epoch, step) where the current streak began
        self.applied = 0
        """Steps this run applied (not skipped)."""

    def observe(
        self,
        *,
        epoch: int,
        steps: range,
        skipped_steps: Sequence[int],
        nonfinite_steps: Sequence[Sequence[int]],
        names: Sequence[str],
    ) -> Decision:
        skipped = set(skipped_steps)
        for step in steps:
            if step not in skipped:
                self.streak, self._culprits = 0, {}
                self.applied += 1
                continue
            self.streak += 1
            if self.streak == 1:
                self._first = (epoch, step)
            for rank, bad in enumerate(nonfinite_steps):
                if step in bad:
                    self._culprits.setdefault(rank, step)
            if self.streak >= self.max_steps:
                first_epoch, first = self._first  # a streak may span an epoch's end, where steps start at 0 again
                where = f"epoch {epoch}, steps {first}-{step}"
                if first_epoch != epoch:
                    where = f"epoch {first_epoch} step {first} to epoch {epoch} step {step}"
                return Stop(
                    f"{self.streak} steps in a row ({where}) had a NaN or Inf gradient "
                    f"and were skipped on every worker. Non-finite loss: {self._who(names)}"
                )
        return Noop()

    def at_end(self, names: Sequence[str]) -> Decision:
        """When the run ends: Stop when it ran steps but applied none (each skipped as NaN/Inf, fewer than the
        limit in a row): its weights are the ones it started with, and it must not end as if it trained."""
        if self.applied or not self.streak:
            return Noop()
        return Stop(
            f"no step of this run was applied: all {self.streak} had a NaN or Inf gradient and were skipped on "
            f"every worker, so the weights are the ones it started with. Non-finite loss: {self._who(names)}. "
            "Check the data (NaN or Inf in it) and the learning rate"
        )

    def _who(self, names: Sequence[str]) -> str:
        who = "; ".join(f"{names[r]} from step {s}" for r, s in sorted(self._culprits.items()))
        return who or "none (the summed gradients themselves overflowed)"


def recovery_source(committed: Mapping[int, int]) -> tuple[int, list[int]]:
    """After a round a lost peer cut short, from each survivor's committed steps (by rank): the survivor
    the others continue from (the most committed steps; the lowest rank among equals), and the survivors
    behind it, which must take its state. A step's global result is the same on every replica that saw it,
    so the most advanced survivor's state is a state every replica would have reached."""
    source = min(committed, key=lambda r: (-committed[r], r))
    return source, [r for r in sorted(committed) if committed[r] < committed[source]]
