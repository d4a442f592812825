"""Callbacks, max_steps, eval_every, EarlyStopping and keep_best in real runs (Ray workers, gloo): each hook fires
as often as metrics.jsonl says, through a lost worker and a resume; the weights stay those of one process."""

from __future__ import annotations

import functools

import pytest

from mixtrain import EarlyStopping, RunConfig, ScalingConfig, Trainer
from mixtrain.callbacks import (
    CheckpointSaved,
    Evaluated,
    RoundEnded,
    RunEnded,
    RunStarted,
    WorkersChanged,
)
from mixtrain.checkpoint import CheckpointStore
from tests.conftest import run_records
from tests.models import data, faulty_task
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference
from tests.unit.test_callbacks import Recorder

pytestmark = pytest.mark.usefixtures("ray_session")


def fit(task, tmp_path, callbacks, workers=3, resume=None, **run):
    x, y = data("mlp", NUM_SAMPLES)
    ex, ey = data("mlp", 256, seed=2)
    trainer = Trainer(
        task,
        (x, y),
        eval_data=(ex, ey),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=workers, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=4, progress=False, **run),
        callbacks=callbacks,
    )
    return trainer.fit(epochs=1, resume=resume), (x, y)


def test_hooks_through_a_lost_worker_and_a_resume_with_max_steps_eval_every_and_the_best_kept(tmp_path, monkeypatch):
    """Worker 1 of 3 is SIGKILLed at its 9th step; the run stops at max_steps=25 (inside the 30-step epoch),
    evaluating every 10 steps and keeping the best; the resume goes on to step 45, its EarlyStopping counting on.
    Every hook fires once per record in metrics.jsonl, and the weights are one process's after 25 and 45 steps."""
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    task = functools.partial(faulty_task, "mlp", "sgd", "kill", 1, 9, str(tmp_path / "fired"))
    rec, stop = Recorder(), EarlyStopping("loss", patience=50)
    common = {"max_steps": 25, "eval_every": 10, "keep_best": ("accuracy", "max"), "keep_checkpoints": 1}
    result, (x, y) = fit(task, tmp_path, [rec, stop], rejoin=False, **common)
    run_dir = result.run_dir

    [started], [ended] = rec.of(RunStarted), rec.of(RunEnded)
    assert started.global_step == 0 and started.max_steps == 25 and started.steps_per_epoch == 30
    assert started.config["global_batch"] == GLOBAL_BATCH and ended.result is result and ended.error is None
    rounds = rec.of(RoundEnded)
    assert len(rounds) == len(run_records(run_dir, "round")) == len(result.history)
    assert rounds[-1].global_step == 25 and sum(r["num_steps"] for r in result.history) == 25
    assert [e.global_step for e in rec.of(Evaluated)] == [10, 20, 25] == [e["global_step"] for e in result.evals]
    assert [c.global_step for c in rec.of(CheckpointSaved)] == [
        c["global_step"] for c in run_records(run_dir, "checkpoint")
    ]
    [lost] = rec.of(WorkersChanged)
    assert lost.kind == "lost" and lost.workers[0]["rank"] == 1
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y, max_steps=25))
    best_at = max(result.evals, key=lambda e: e["accuracy"])["global_step"]
    assert result.best_checkpoint == run_dir / "checkpoints" / f"step-{best_at:09d}"
    names = {p.name for p in CheckpointStore(run_dir).paths()}
    assert names == {"step-000000025", f"step-{best_at:09d}"}  # keep_checkpoints=1, and the best beside it
    counted = stop.bad_evals

    rec2, stop2 = Recorder(), EarlyStopping("loss", patience=50)
    common["max_steps"] = 45
    task2 = functools.partial(faulty_task, "mlp", "sgd", "kill", -1, 0, str(tmp_path / "never"))
    again, _ = fit(task2, tmp_path, [rec2, stop2], workers=2, resume=run_dir, **common)
    [started2] = rec2.of(RunStarted)
    assert started2.global_step == 25 and started2.resumed_from is not None
    assert stop2.bad_evals >= counted and stop2.best is not None  # counting went on from the checkpoint
    assert [e.global_step for e in rec2.of(Evaluated)] == [30, 40, 45]
    assert sum(r.record["num_steps"] for r in rec2.of(RoundEnded)) == 20  # steps 25 to 45, each once
    assert rec2.of(RoundEnded)[-1].global_step == 45 and not rec2.of(WorkersChanged)
    assert_same_weights(again.state_dict, reference("mlp", "sgd", x, y, epochs=2, max_steps=45))
    best = max(result.evals + again.evals, key=lambda e: e["accuracy"])["global_step"]
    assert again.best_checkpoint == run_dir / "checkpoints" / f"step-{best:09d}"


def test_early_stopping_ends_a_real_run_with_a_checkpoint_and_the_final_weights(tmp_path):
    """A learning rate of 0 never improves the held-out loss: patience 2 ends the run at its third evaluation,
    step 6, with a checkpoint there and the final weights written; fit() returns and says why. (min_delta: the
    held-out loss is summed over slices sized by speed, so its last bits move with the split.)"""
    from tests.models import factory

    rec = Recorder()
    result, _ = fit(
        factory("mlp", "frozen"), tmp_path, [rec, EarlyStopping("loss", patience=2, min_delta=1e-6)], eval_every=2
    )
    assert result.stopped_early is not None and "for 2 evaluations" in result.stopped_early
    assert [e["global_step"] for e in result.evals] == [2, 4, 6]
    assert sum(r["num_steps"] for r in result.history) == 6 and result.model_path.is_file()
    assert run_records(result.run_dir, "checkpoint")[-1]["global_step"] == 6
    assert rec.of(RunEnded)[0].stopped_early == result.stopped_early
