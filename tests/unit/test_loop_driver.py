"""The loop's driver (train/_driver.py), one transition at a time, without Ray: a fake LoopPort answers each attempt
from a script, as tests/unit/test_controller.py does for the Task path."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from mixtrain.driver.interrupt import TrainingInterrupted
from mixtrain.group.membership import Member, Membership
from mixtrain.policies.decisions import FailureBudget
from mixtrain.train._driver import (
    AttemptOutcome,
    BringUp,
    Done,
    Failed,
    Interrupted,
    LeavingOut,
    LoopDriver,
    Lost,
    Restarting,
    Running,
)
from mixtrain.train._result import TrainingFailedError
from tests.unit.test_controller import member as controller_member

RUN_DIR = Path("/runs/loop-7")
CHECKPOINT = "/runs/loop-7/checkpoints/checkpoint-000002"


def member(bundle: int, rank: int) -> Member:
    """The worker of `bundle` (the rank it started with), now at `rank`."""
    return controller_member(rank, bundle)


class FakeLoop:
    """The LoopPort in memory. `outcomes` scripts the attempts (the default: the loop finishes everywhere);
    `empty` the bundles a restart finds no worker for; `calls` records what the driver asked."""

    def __init__(self, num_workers: int = 3) -> None:
        self.bundles = list(range(num_workers))
        self.members = Membership([member(b, r) for r, b in enumerate(self.bundles)])
        self.outcomes: deque[AttemptOutcome] = deque()
        self.calls: list[tuple[str, Any]] = []
        self.leaving: dict[str, Any] | None = None
        self.empty: list[int] = []
        self.latest: str | None = None
        self.resumes = True
        self.loop_name = "train_fn"
        self.log_dir: Path | None = RUN_DIR / "logs"

    def bring_up(self) -> None:
        self.calls.append(("bring_up", len(self.members)))

    def run_attempt(self, attempt: int) -> AttemptOutcome:
        self.calls.append(("run_attempt", attempt))
        return self.outcomes.popleft() if self.outcomes else AttemptOutcome()

    def take_leaving(self) -> dict[str, Any]:
        assert self.leaving is not None, "the driver asked who leaves where nobody does"
        leaving, self.leaving = self.leaving, None
        return leaving

    def restart(self, excluded: Sequence[int]) -> list[int]:
        self.calls.append(("restart", list(excluded)))
        self.bundles = [b for b in self.bundles if b not in excluded and b not in self.empty]
        self.members = Membership([member(b, r) for r, b in enumerate(self.bundles)])
        return list(self.empty)

    def reload_checkpoint(self) -> str | None:
        self.calls.append(("reload_checkpoint", self.latest))
        return self.latest

    def last_checkpoint(self) -> str | None:
        return self.latest

    def asked(self, name: str) -> list[Any]:
        return [arg for call, arg in self.calls if call == name]


class Log:
    run_dir = RUN_DIR

    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self.records.append((kind, record))

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [r for k, r in self.records if k == kind]


class View:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def driver(
    port: FakeLoop, *, max_failures: int = 3, window_s: float = 3600.0, clock: Clock | None = None
) -> tuple[LoopDriver, Log, View]:
    log, view = Log(), View()
    made = LoopDriver(
        port,  # type: ignore[arg-type]
        FailureBudget(max_failures, window_s),
        log=log,  # type: ignore[arg-type]
        view=view,  # type: ignore[arg-type]
        clock=clock or Clock(),
    )
    return made, log, view


def test_a_loop_that_finishes_on_every_worker_the_first_time_is_one_attempt():
    port = FakeLoop()
    drv, log, view = driver(port)
    assert drv.step(BringUp(0)) == Running(0)
    assert drv.step(Running(0)) == Done()
    drv.run()
    assert port.calls == [("bring_up", 3), ("run_attempt", 0)] * 2
    assert not port.asked("restart") and not log.records and not drv.interrupted
    assert not any("starts again" in line for line in view.lines)


def test_a_lost_worker_counts_one_failure_and_the_loop_starts_again_on_every_bundle_from_its_checkpoint():
    port = FakeLoop(3)
    port.outcomes.append(AttemptOutcome(lost={1: "its process died"}))
    port.latest = CHECKPOINT
    drv, log, view = driver(port)
    assert drv.step(Running(0)) == Lost(0, {1: "its process died"})
    assert drv.step(Lost(0, {1: "its process died"})) == Restarting(0)
    assert drv.step(Restarting(0)) == BringUp(1)
    assert port.asked("restart") == [[]]  # nobody left out: the lost one's bundle gets a new process
    assert log.kinds("failure") == [{"attempt": 0, "lost": {1: "its process died"}, "failures": 1}]
    assert view.lines == [
        "worker 1 (cpu 1 on 10.0.0.1) lost: its process died",
        "failure 1 of at most 3 per 60 minutes",
        f"the loop starts again on 3 workers from {CHECKPOINT}",
    ]
    assert drv.budget.failures == 1


def test_a_run_with_a_lost_worker_goes_on_and_finishes_in_its_second_attempt():
    port = FakeLoop(3)
    port.outcomes.append(AttemptOutcome(lost={2: "its node left"}))
    port.empty = [2]  # its node is gone: its bundle stays empty
    drv, log, view = driver(port)
    drv.run()
    assert port.asked("run_attempt") == [0, 1] and port.asked("bring_up") == [3, 2]
    assert view.lines[-1] == (
        "the loop starts again on 2 workers from the start (no checkpoint reported yet); bundles [2] have no worker now"
    )
    assert [r["failures"] for r in log.kinds("failure")] == [1]


def test_a_restart_of_a_loop_that_never_reads_its_checkpoint_says_it_trains_again_from_the_start():
    port = FakeLoop(2)
    port.outcomes.append(AttemptOutcome(lost={0: "its process died"}))
    port.latest, port.resumes = CHECKPOINT, False
    drv, _, view = driver(port)
    drv.run()
    assert view.lines[-1].startswith("the loop starts again on 2 workers from the start: the loop never calls")
    assert f"(its last checkpoint, {CHECKPOINT}, is kept)" in view.lines[-1]


def test_more_failures_than_the_budget_allows_within_the_window_end_the_run_with_the_resume_hint():
    port = FakeLoop(3)
    port.outcomes.extend([AttemptOutcome(lost={1: "its process died"}), AttemptOutcome(lost={0: "its node left"})])
    port.latest = CHECKPOINT
    clock = Clock()
    drv, log, _ = driver(port, max_failures=1, clock=clock)
    assert drv.step(Lost(0, {1: "its process died"})) == Restarting(0)  # the first is within the budget
    clock.now = 600.0  # ten minutes later: within the hour
    failed = drv.step(Lost(1, {0: "its node left"}))
    assert isinstance(failed, Failed)
    assert failed.message == (
        f"training stopped: 2 failures within 60 minutes, max_failures=1. The last checkpoint, {CHECKPOINT}, is "
        f"intact; continue with RunConfig(name='loop-7') (the same storage_path), or `mixtrain run ... --resume "
        f"{RUN_DIR}`."
    )
    assert [r["attempt"] for r in log.kinds("failure")] == [0, 1]  # recorded, the one that ends the run too
    assert port.asked("restart") == []


def test_failures_further_apart_than_the_window_do_not_add_up():
    port = FakeLoop(3)
    clock = Clock()
    drv, _, _ = driver(port, max_failures=1, window_s=3600.0, clock=clock)
    assert drv.step(Lost(0, {1: "its process died"})) == Restarting(0)
    clock.now = 3601.0
    assert drv.step(Lost(1, {1: "its process died"})) == Restarting(1)


def test_a_spent_budget_raises_training_failed_from_run_and_restarts_nothing():
    port = FakeLoop(2)
    port.outcomes.append(AttemptOutcome(lost={0: "its process died", 1: "its process died"}))
    drv, _, _ = driver(port, max_failures=3)
    with pytest.raises(TrainingFailedError, match=r"training stopped: no worker is left\. No checkpoint was reported"):
        drv.run()
    assert port.asked("run_attempt") == [0] and port.asked("restart") == []


def test_a_worker_named_at_a_report_is_left_out_and_its_bundle_gets_no_worker_again():
    port = FakeLoop(3)
    port.members = Membership([member(0, 0), member(2, 1)])  # bundle 1 left out earlier: rank 1 is bundle 2's
    port.bundles = [0, 2]
    port.outcomes.append(AttemptOutcome(stopped_at_report=True))
    port.leaving = {"rank": 1, "reason": "measured: 1.6x faster without it"}
    port.latest = CHECKPOINT
    drv, log, view = driver(port)
    assert drv.step(Running(4)) == LeavingOut(4)
    assert drv.step(LeavingOut(4)) == Restarting(4, (2,))  # the bundle, not the current rank
    [left] = log.kinds("left_out")
    assert left == {"attempt": 4, "worker": member(2, 1).info, "reason": "measured: 1.6x faster without it"}
    assert view.lines == ["left out worker 1 (cpu 2 on 10.0.0.1): measured: 1.6x faster without it"]
    assert port.leaving is None  # taken: it does not stand for the next attempt
    assert drv.step(Restarting(4, (2,))) == BringUp(5)
    assert port.asked("restart") == [[2]] and port.bundles == [0]
    assert view.lines[-1] == f"the loop starts again on 1 workers from {CHECKPOINT}"
    assert drv.budget.failures == 0 and not log.kinds("failure")  # a leave-out is no failure


def test_a_leave_out_then_the_finished_loop_ends_the_run_on_the_workers_left():
    port = FakeLoop(2)
    port.outcomes.append(AttemptOutcome(stopped_at_report=True))
    port.leaving = {"rank": 0, "reason": "slow"}
    drv, _, _ = driver(port)
    drv.run()
    assert port.asked("run_attempt") == [0, 1] and port.asked("bring_up") == [2, 1]
    assert [m.spec.rank for m in port.members] == [1]


def test_ctrl_c_stops_the_run_at_a_report_with_the_resume_hint():
    port = FakeLoop(2)
    port.outcomes.append(AttemptOutcome(stopped_at_report=True, interrupted=True))
    port.leaving = {"rank": 1, "reason": "slow"}  # a leave-out named as well: Ctrl-C wins, nobody restarts
    port.latest = CHECKPOINT
    drv, log, _ = driver(port)
    state = drv.step(Running(2))
    assert isinstance(state, Interrupted) and state.message.startswith("stopped at a report. The last checkpoint")
    assert drv.interrupted and log.kinds("interrupted") == [{"attempt": 2}]
    port.outcomes.append(AttemptOutcome(interrupted=True))
    with pytest.raises(TrainingInterrupted, match=r"stopped at a report\. .*--resume /runs/loop-7`"):
        driver(port)[0].run()
    assert port.asked("restart") == [] and port.leaving is not None


def test_ctrl_c_during_an_attempt_that_lost_a_worker_recovers_first():
    port = FakeLoop(2)
    port.outcomes.append(AttemptOutcome(lost={1: "its process died"}, interrupted=True))
    drv, log, _ = driver(port)
    assert drv.step(Running(0)) == Lost(0, {1: "its process died"})
    assert not drv.interrupted and not log.kinds("interrupted")


def test_a_loop_that_raised_ends_the_run_naming_the_worker_its_traceback_and_the_logs():
    port = FakeLoop(3)
    port.outcomes.append(AttemptOutcome(lost={0: "its process died"}, raised=(2, "Traceback ...\nValueError: bad\n")))
    drv, log, _ = driver(port)
    with pytest.raises(TrainingFailedError) as err:
        drv.run()
    assert str(err.value) == (
        "worker 2 (cpu 2 on 10.0.0.1) raised in train_fn:\nTraceback ...\nValueError: bad\n"
        f"(each worker's output: {RUN_DIR}/logs/worker-*.log)"
    )
    assert port.asked("restart") == [] and drv.budget.failures == 0 and not log.kinds("failure")


def test_a_raising_loop_without_worker_logs_names_no_log_folder():
    port = FakeLoop(1)
    port.log_dir = None
    port.outcomes.append(AttemptOutcome(raised=(0, "ZeroDivisionError: division by zero")))
    drv, _, _ = driver(port)
    assert drv.step(Running(0)) == Failed(
        "worker 0 (cpu 0 on 10.0.0.1) raised in train_fn:\nZeroDivisionError: division by zero"
    )
