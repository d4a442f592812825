"""The objects that decide for themselves when they are due, without Ray: the Evaluator (every eval_every global
steps or at each epoch's end, and at the run's last point whenever there is held-out data) and the Checkpointer
(at the last point or once checkpoint_every_s have passed, never twice at one point; after an evaluation, marked
best by the metric's mode). They run inside test_controller.py's controller, over its fake group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_controller import FakeGroup, controller

STEPS = 8  # per epoch (test_controller.NUM_SAMPLES / GLOBAL_BATCH)


def test_an_evaluation_is_due_every_eval_every_global_steps_and_at_the_runs_last_point(tmp_path):
    ctl, _ = controller(FakeGroup(), tmp_path, num_eval=10, eval_every=3)
    due = [g for g in range(1, 2 * STEPS + 1) if ctl.evaluator.due(*divmod(g, STEPS))]
    assert due == [3, 6, 9, 12, 15]  # counted in global steps, across the epoch's end
    assert not ctl.evaluator.due(1, STEPS) and ctl.evaluator.due(1, STEPS, last=True)  # step 16 ends the run


def test_without_eval_every_an_evaluation_is_due_at_each_epochs_end(tmp_path):
    ctl, _ = controller(FakeGroup(), tmp_path, num_eval=10)
    assert [s for s in range(1, STEPS + 1) if ctl.evaluator.due(0, s)] == [STEPS]
    assert ctl.evaluator.due(0, 5, last=True)  # max_steps or StopTraining ending the run inside the epoch


def test_no_evaluation_is_due_without_held_out_data(tmp_path):
    ctl, _ = controller(FakeGroup(), tmp_path, eval_every=2)
    assert not any(ctl.evaluator.due(e, s, last=True) for e in range(2) for s in range(1, STEPS + 1))


def checkpointer_on_a_clock(tmp_path, every_s: float = 60.0, **more):
    ctl, log = controller(FakeGroup(), tmp_path, **more)
    now = [0.0]
    ctl.checkpoints.clock = lambda: now[0]
    ctl.checkpoints.settings = replace(ctl.checkpoints.settings, checkpoint_every_s=every_s)
    ctl.checkpoints.restart_clock()
    return ctl, log, now


def test_a_checkpoint_is_due_at_the_last_point_or_by_time_and_never_twice_at_one_point(tmp_path):
    ctl, log, now = checkpointer_on_a_clock(tmp_path)
    ck = ctl.checkpointer
    assert not ck.due((0, 2)) and ck.due((0, 2), last=True)
    now[0] = 59.0
    assert ck.save((0, 2)) is None and not log.kinds("checkpoint")
    now[0] = 60.0
    assert ck.due((0, 2)) and ck.save((0, 2)) is None
    assert [(c["epoch"], c["step"]) for c in log.kinds("checkpoint")] == [(0, 2)]
    assert not ck.due((0, 4))  # the clock starts again at each checkpoint
    now[0] = 500.0
    assert not ck.due((0, 2)) and not ck.due((0, 2), last=True)  # the last one continues there already
    assert ck.due((0, 4))
    ck.save((0, 4), last=True)
    assert [c["step"] for c in log.kinds("checkpoint")] == [2, 4]


def test_no_checkpoint_is_due_without_a_store(tmp_path):
    ctl, log, now = checkpointer_on_a_clock(tmp_path)
    ctl.checkpoints.store = None
    now[0] = 500.0
    assert not ctl.checkpointer.due((0, 2), last=True) and ctl.checkpointer.save((0, 2), last=True) is None
    assert ctl.checkpointer.after_evaluation({"loss": 0.5}, (0, 2)) is None and not log.kinds("checkpoint")


@pytest.mark.parametrize(("mode", "best"), [("min", "step-000000004"), ("max", "step-000000006")])
def test_each_evaluation_gets_its_checkpoint_and_the_best_is_kept_by_the_metrics_mode(tmp_path, mode, best):
    ctl, log, _ = checkpointer_on_a_clock(tmp_path, num_eval=10, keep_best=("loss", mode))
    ctl.checkpoints.store.keep = 1  # type: ignore[union-attr]
    for step, loss in [(2, 0.5), (4, 0.2), (6, 0.9), (8, 0.3)]:
        ctl.checkpointer.after_evaluation({"loss": loss}, (0, step))
    assert [c["step"] for c in log.kinds("checkpoint")] == [2, 4, 6, 8]  # whatever the clock says
    assert ctl.checkpoints.best is not None and ctl.checkpoints.best.name == best
    assert ctl.best_checkpoint == tmp_path / "checkpoints" / best  # kept beside the newest one


def test_an_evaluation_where_the_last_checkpoint_is_writes_again_only_for_a_new_best(tmp_path):
    ctl, log, _ = checkpointer_on_a_clock(tmp_path, num_eval=10, keep_best=("loss", "min"))
    ck = ctl.checkpointer
    ck.save((0, 4), last=True)
    ck.after_evaluation({"loss": 0.5}, (0, 4))  # the first evaluation is the best so far
    ck.save((0, 6), last=True)
    ck.after_evaluation({"loss": 0.9}, (0, 6))  # no better: the checkpoint at step 6 holds it already
    ck.after_evaluation(None, (0, 6))  # evaluated already at this step
    assert [c["step"] for c in log.kinds("checkpoint")] == [4, 4, 6]
    assert ctl.best_checkpoint == tmp_path / "checkpoints" / "step-000000004"


def test_without_keep_best_an_evaluation_still_gets_its_checkpoint_once(tmp_path):
    ctl, log, _ = checkpointer_on_a_clock(tmp_path, num_eval=10)
    ctl.checkpointer.after_evaluation({"loss": 0.5}, (0, 2))
    ctl.checkpointer.after_evaluation({"loss": 0.1}, (0, 2))
    assert [c["step"] for c in log.kinds("checkpoint")] == [2] and ctl.best_checkpoint is None
