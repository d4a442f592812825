"""A loop's session measures each worker's compute from one batch to the next, and an EMULATED slowdown stretches
each step by what the step itself computed, not by what earlier stretches added (issue 35)."""

from __future__ import annotations

import time

import pytest
import torch

from mixtrain.train import _api
from mixtrain.train import _session as sessions
from mixtrain.train._session import LoopSession, TrainContext


def _session() -> LoopSession:
    ctx = TrainContext(
        world_rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, device=torch.device("cpu"),
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

    def slower(seconds: float) -> None:  # what core/emulation.py hooks in: a device 3x slower
        told.append(seconds)
        clock[0] += 2 * seconds

    session.after_compute.append(slower)
    for _ in range(6):
        session.begin_batch(10, 10)
        clock[0] += 0.02  # the step's own compute
    assert told == pytest.approx([0.02] * 5), told  # not 0.02, 0.06, 0.18, ... (each stretch stretched again)
    # each hook's stretch falls into the next step's time: the first step measured 20 ms, the four after it 60 ms
    assert session.speed() == pytest.approx(50 / (0.02 + 4 * 0.06)), session.speed()
    assert session.weight == 1.0


def test_the_weight_is_the_batchs_share_of_its_step_and_between_epochs_nothing_counts():
    session = _session()
    session.begin_batch(3, 12)
    assert session.weight == 0.25
    session.end_epoch()
    time.sleep(0.05)  # an evaluation between epochs
    session.begin_batch(0, 5)
    assert session.weight == 0.0 and session.speed() == 0.0


def test_a_leave_out_is_named_after_two_plan_points_in_a_row_and_withdrawn_when_one_finds_none():
    session, slow = _session(), {1: "the job is 1.5x faster without it"}
    session.resumes = True  # the loop called get_checkpoint(): a restart goes on from its checkpoint
    assert session.leave_out_vote(slow) == {}  # one noisy measurement costs no device
    assert session.leave_out_vote(slow) == {"leave_out": {"rank": 1, "reason": slow[1]}}
    assert session.leave_out_vote(slow) == {}  # told once
    assert session.leave_out_vote({}) == {"leave_out": None}  # withdrawn
    assert session.leave_out_vote(slow) == {}


def test_a_loop_that_never_asked_for_its_checkpoint_keeps_the_worker_and_the_driver_is_told_once():
    # Leaving a worker out restarts the loop; one that never calls get_checkpoint() would train from epoch 0 again.
    session, slow = _session(), {1: "the job is 1.5x faster without it"}
    assert session.leave_out_vote(slow) == {}
    assert session.leave_out_vote(slow) == {"leave_out_kept": {"rank": 1, "reason": slow[1]}}
    assert session.leave_out_vote(slow) == {} and session.leave_out_vote(slow) == {}  # said once
    assert not session.leave_out_named
    sessions.start(session)
    try:
        assert _api.get_checkpoint() is None  # a loop that asks (here at its start, with nothing to resume yet)
    finally:
        sessions.end()
    assert session.leave_out_vote(slow) == {"leave_out": {"rank": 1, "reason": slow[1]}}


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
    for pause in (0.01, 0.01, 0.01):
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.01)
    for pause in (0.04, 0.04, 0.04):  # the device got 4x slower
        clock[0] += pause
        session.begin_batch(10, 10)
    assert session.measured()[0] == pytest.approx(10 / 0.04) and session.speed() > 10 / 0.035  # not the average


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
    assert session.speed() == pytest.approx(40 / 0.04)  # 10 ms per step, the wait nowhere


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
