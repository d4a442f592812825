"""A loop's session measures each worker's compute from one batch to the next, and an EMULATED slowdown stretches
each step by what the step itself computed, not by what earlier stretches added (issue 35)."""

from __future__ import annotations

import time

import pytest
import torch

from mixtrain.train import _api
from mixtrain.train import _session as sessions
from mixtrain.train._prepare import plan_shares
from mixtrain.train._session import LoopSession, TrainContext


def _session(world_size: int = 1) -> LoopSession:
    ctx = TrainContext(
        world_rank=0, world_size=world_size, local_rank=0, local_world_size=1, node_rank=0, device=torch.device("cpu"),
        experiment_name="t",
    )  # fmt: skip
    return LoopSession(
        context=ctx, seed=0, shares="auto", bucket_bytes=1 << 20, report_to=lambda *a: False, plan_to=lambda r: None
    )


def test_a_slowdown_hook_is_told_each_steps_own_compute_and_the_speed_includes_what_it_added(monkeypatch):
    # A clock that moves only when the step computes or the hook sleeps: the figures are exact, whatever the
    # machine's load (with real sleeps a loaded CI machine once stretched a 20 ms sleep to 196 ms).
    clock = [0.0]
    monkeypatch.setattr("mixtrain.train._session.time.perf_counter", lambda: clock[0])
    session, told = _session(), []

    def slower(seconds: float) -> None:  # what worker/emulation.py hooks in: a device 3x slower
        told.append(seconds)
        clock[0] += 2 * seconds

    session.after_compute.append(slower)
    for _ in range(6):
        session.begin_batch(10, 10)
        clock[0] += 0.02  # the step's own compute
    assert told == pytest.approx([0.02] * 5), told  # not 0.02, 0.06, 0.18, ... (each stretch stretched again)
    # each hook's stretch falls into the next step's time: the first step measured 20 ms, the four after it 60 ms
    assert [compute for _, compute in session._window] == pytest.approx([0.02] + [0.06] * 4), session._window
    assert session.measured()[0] == pytest.approx(10 / 0.06) and session.weight == 1.0


def test_the_weight_is_the_batchs_share_of_its_step_and_between_epochs_nothing_counts():
    session = _session()
    session.begin_batch(3, 12)
    assert session.weight == 0.25
    session.end_epoch()
    time.sleep(0.05)  # an evaluation between epochs
    session.begin_batch(0, 5)
    assert session.weight == 0.0 and session._window == [] and session.measured()[0] == 0.0


def _pair(measured: list[tuple[float, float, float]]) -> tuple[LoopSession, list[dict]]:
    """A session of rank 0 of two whose gathered figures (speed, exchange s, wall s a step) are `measured`."""
    session, plans = _session(world_size=2), []
    session.leave_out_gain, session.plan_to = 0.2, plans.append
    session.gather = lambda values: [list(m) for m in measured]  # type: ignore[method-assign]
    return session, plans


def test_a_leave_out_is_named_after_two_plan_points_in_a_row_and_withdrawn_when_one_finds_none():
    # The loop asks the Task path's Rebalancer (one policy for both doors): worker 1 computes 50x slower.
    session, plans = _pair([(1000.0, 0.001, 0.0), (20.0, 0.001, 0.0)])
    session.resumes = True  # the loop called get_checkpoint(): a restart goes on from its checkpoint
    for step in (2, 4, 8):
        plan_shares(session, 32, [16, 16], (0, step))
    named = [p.get("leave_out", "-") for p in plans]
    assert named[0] == "-" and named[1]["rank"] == 1 and "faster without it" in named[1]["reason"], plans
    assert "leave_out" not in plans[-1]  # the third plan point votes again: still named, not told again
    session.gather = lambda values: [[1000.0, 0.001, 0.0], [1000.0, 0.001, 0.0]]  # type: ignore[method-assign]
    plan_shares(session, 32, plans[-1]["shares"], (0, 16))
    assert plans[-1]["leave_out"] is None  # withdrawn: the next plan point found nobody


def test_a_loop_that_never_asked_for_its_checkpoint_keeps_the_worker_and_the_driver_is_told_once():
    # Leaving a worker out restarts the loop; one that never calls get_checkpoint() would train from epoch 0 again.
    session, plans = _pair([(1000.0, 0.001, 0.0), (20.0, 0.001, 0.0)])
    for step in (2, 4, 8, 16, 32):
        plan_shares(session, 32, [16, 16], (0, step))
    kept = [p["leave_out_kept"] for p in plans if "leave_out_kept" in p]
    assert [k["rank"] for k in kept] == [1] and not any("leave_out" in p for p in plans)  # said once
    assert not session.leave_out_named
    sessions.start(session)
    try:
        assert _api.get_checkpoint() is None  # a loop that asks (here at its start, with nothing to resume yet)
    finally:
        sessions.end()
    told = len(plans)
    for step in (64, 128):
        plan_shares(session, 32, [16, 16], (0, step))
    assert [p["leave_out"]["rank"] for p in plans[told:] if "leave_out" in p] == [1]


def test_a_loop_leaves_out_by_the_wall_clock_as_a_task_does_and_moves_shares_only_past_the_threshold():
    # Two workers of nearly one speed: the model sees no reason to leave one out, but the wall clock says the pair
    # runs 32 samples a 0.064 s step (500 samples/s) while worker 0 alone computes 1,000 (the Task path's measured
    # check, which the loop's own vote never had). The shares stay 16:16 (within the imbalance threshold).
    session, plans = _pair([(1000.0, 0.001, 0.064), (950.0, 0.001, 0.064)])
    session.resumes = True
    assert plan_shares(session, 32, [16, 16], (0, 2)) is None  # the first interval holds the loader's start-up
    assert plan_shares(session, 32, [16, 16], (0, 4)) is None
    assert plan_shares(session, 32, [16, 16], (0, 8)) is None
    [told] = [p for p in plans if p.get("leave_out")]
    assert told["leave_out"]["rank"] == 1 and "alone would compute 1,000" in told["leave_out"]["reason"], told
    assert told["step"] == 8 and told["shares"] == [16, 16] and not told["moved"]
    assert session.in_force == {32: [16, 16]}


def test_an_epoch_starts_from_the_shares_the_last_one_ended_with_unless_they_are_off_by_the_threshold():
    session, plans = _pair([(1000.0, 0.001, 0.0), (330.0, 0.001, 0.0)])  # 3x slower: about 24:8
    first = plan_shares(session, 32, None, (1, 0))
    assert first == [24, 8], first
    session.gather = lambda values: [[1000.0, 0.001, 0.0], [350.0, 0.001, 0.0]]  # type: ignore[method-assign]
    assert plan_shares(session, 32, None, (2, 0)) == [24, 8]  # within the threshold: kept, not re-cut to 24:8's
    assert [p["shares"] for p in plans] == [[24, 8], [24, 8]] and plans[1]["moved"]  # an epoch's start is said


def test_each_prepared_loaders_global_batch_is_the_first_attempts_whatever_a_later_one_asks():
    told: list[tuple[str, dict]] = []
    first = _session()
    first.batch_workers, first.event_to = 2, lambda kind, record: told.append((kind, record))
    assert [first.loader_global_batch(b) for b in (16, 5)] == [32, 10]  # batch_size x the 2 workers asked for
    assert told == [
        ("loader", {"index": 0, "global_batch": 32, "asked": 32}),
        ("loader", {"index": 1, "global_batch": 10, "asked": 10}),
    ]
    told.clear()
    later = _session()  # after a leave-out: world size 1, so BATCH // world_size asks twice the batch
    later.batch_workers, later.global_batches = 2, [32, 10]
    later.event_to = lambda kind, record: told.append((kind, record))
    assert [later.loader_global_batch(b) for b in (32, 5, 4)] == [32, 10, 8]  # a third loader: its own
    assert told == [
        ("loader", {"index": 0, "global_batch": 32, "asked": 64}),
        ("loader", {"index": 2, "global_batch": 8, "asked": 8}),
    ]


def test_plans_look_at_the_speed_since_the_last_plan_and_the_loader_looks_again_at_2_4_8_and_every_128(
    monkeypatch,
):
    """On a fake clock: real sleeps of 10 ms took several times that on a loaded machine (a fresh-clone run)."""
    from mixtrain.train._prepare import _plan_point

    assert [t for t in range(1, 600) if _plan_point(t)] == [2, 4, 8, 16, 32, 64, 128, 256, 384, 512]
    clock = [0.0]
    monkeypatch.setattr("mixtrain.train._session.time.perf_counter", lambda: clock[0])
    session = _session()
    session.begin_batch(10, 10)
    for pause in (0.05, 0.05, 0.05):  # 0.15 s of compute: the window closes at this plan
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.05)
    for pause in (0.2, 0.2, 0.2):  # the device got 4x slower
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.2)  # not the average over both


def test_a_plan_of_millisecond_steps_sees_past_a_stretched_step_and_waits_for_a_tenth_of_a_second_of_them(
    monkeypatch,
):
    """Steps of a millisecond, one of them stretched 20x (the scheduler, the garbage collector on a loaded machine):
    the speed is the median step's, and the window goes on growing until it holds MEASURE_WINDOW_S of compute (a CI
    run once moved a 3x-slow worker's shares above the fast one's on two such steps). Two steps are not enough:
    nothing measured until a third."""
    from mixtrain.train._session import MEASURE_WINDOW_S

    clock = [0.0]
    monkeypatch.setattr("mixtrain.train._session.time.perf_counter", lambda: clock[0])
    session = _session()
    session.begin_batch(10, 10)
    for pause in (0.001, 0.02):
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == 0.0
    clock[0] += 0.001
    session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.001)  # the ratio of sums would say 10 / 0.0073
    for pause in (0.001, 0.001):  # the next plan still counts the three above: no 0.1 s of compute yet
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.001) and len(session._window) == 5
    clock[0] += MEASURE_WINDOW_S
    session.begin_batch(10, 10)
    session.measured()
    assert session._window == []  # closed: the next plan measures the steps after it
    clock[0] += 0.004
    session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.001)  # one step is no median: the last window's figure
    for pause in (0.004, 0.004):
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.004)


def test_the_wait_at_a_plan_point_is_no_steps_compute(monkeypatch):
    """A plan point closes the last batch's interval before it gathers the speeds: the wait there for the slowest
    worker (and a loader restarted after a move) once made a fast worker look as slow as the slow one."""
    clock = [0.0]
    monkeypatch.setattr("mixtrain.train._session.time.perf_counter", lambda: clock[0])
    session = _session()
    for step in range(4):
        session.begin_batch(10, 10)
        clock[0] += 0.01  # the step's compute
        if step == 1:
            session.close_interval()  # a plan point: then 0.5 s waiting for the others in the gather
            clock[0] += 0.5
    session.close_interval()
    assert [compute for _, compute in session._window] == pytest.approx([0.01] * 4)  # the wait nowhere
    assert session.measured()[0] == pytest.approx(10 / 0.01)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_prepared_loader_starts_its_loader_processes_as_the_users_own_and_reads_each_sample_once(
    tmp_path, persistent
):
    """Once an epoch, or once for the run with persistent_workers (a new DataLoader every epoch ignored it); the
    loader processes read ahead only up to the last step the loader hands out (drop_last: 8 of 10 samples)."""
    from torch.utils.data import DataLoader

    from mixtrain.train._prepare import PreparedLoader
    from tests.datasets import Augmented, read_counts

    x, y = torch.randn(10, 4), torch.arange(10) % 3
    data = Augmented(x, y, str(tmp_path))
    user = DataLoader(data, batch_size=4, shuffle=True, drop_last=True, num_workers=1, persistent_workers=persistent)
    session = _session()
    session.batch_workers = 1  # the one worker the run asked for
    loader, epochs = PreparedLoader(user, session), 3
    for epoch in range(epochs):
        assert [len(b[1]) for b in loader] == [4, 4]
        assert sum(read_counts(str(tmp_path)).values()) == 8 * (epoch + 1)  # the epoch's 8 samples, none more
    assert len(list(tmp_path.glob("reads-*.txt"))) == (1 if persistent else epochs)


def test_get_checkpoint_tells_the_driver_once_that_the_loop_resumes_and_a_restart_says_where_it_goes_on():
    # After a lost worker a loop that never asks get_checkpoint() trains again from its first epoch, whatever it
    # reported: the driver said "from <checkpoint>" (issue 45). Rank 0 tells it, once, that this loop does resume.
    from mixtrain.train._trainer import restart_from

    session, told = _session(), []
    session.event_to = lambda kind, record: told.append(kind)
    sessions.start(session)
    try:
        assert _api.get_checkpoint() is None and _api.get_checkpoint() is None
    finally:
        sessions.end()
    assert told == ["resumes"] and session.resumes
    assert restart_from("RUN/checkpoints/checkpoint-000002", resumes=True) == "from RUN/checkpoints/checkpoint-000002"
    line = restart_from("RUN/checkpoints/checkpoint-000002", resumes=False)
    assert line.startswith("from the start: the loop never calls mixtrain.train.get_checkpoint()"), line
    assert restart_from(None, resumes=True) == "from the start (no checkpoint reported yet)"
