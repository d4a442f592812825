"""Kept workers (ScalingConfig.keep_workers): the next fit reuses the processes of the last one, starts sooner,
and trains exactly as new workers would; what the last fit left behind (a user's edited module, torch defaults,
its log file) does not reach the next; other workers, a dead kept worker, or a failed fit start new ones."""

from __future__ import annotations

import functools
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch

import mixtrain
from mixtrain import RunConfig, ScalingConfig, Trainer
from mixtrain.worker import warm_workers
from tests.conftest import run_records
from tests.models import data, factory, from_module, paced_task, raising_factory
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def _fit(tmp_path: Path, name: str, make=None, num_workers: int = 2, keep: bool | None = True, x=None, y=None):
    if x is None:
        x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        make or factory("mlp", "sgd"),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=num_workers, keep_workers=keep, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / name), seed=SEED, steps_per_round=10, progress=False),
    )
    return trainer.fit(epochs=1)


def _pids(result) -> list[int]:
    return [w["pid"] for w in result.workers]


def test_the_next_fit_reuses_the_kept_workers_and_trains_exactly(tmp_path):
    mixtrain.release_workers()
    x, y = data("mlp", NUM_SAMPLES)
    first = _fit(tmp_path, "first")
    assert warm_workers.kept() == 2
    second = _fit(tmp_path, "second")
    assert _pids(second) == _pids(first)
    assert warm_workers.kept() == 2
    want = reference("mlp", "sgd", x, y)
    assert_same_weights(first.state_dict, want)
    assert_same_weights(second.state_dict, want)  # the kept workers start over: same seed, same math
    logs = [sorted(p.name for p in (tmp_path / name / "logs").iterdir()) for name in ("first", "second")]
    assert logs[0] == logs[1] and len(logs[1]) == 2, logs  # each run's worker logs go to its own folder
    assert "worker 0 of 2" in (tmp_path / "second" / "logs" / logs[1][0]).read_text()
    # the processes are started once: the reused fit reaches its first step sooner
    assert second.seconds_to_first_step < first.seconds_to_first_step, (first, second)


def test_an_edited_user_module_and_changed_torch_defaults_do_not_reach_the_next_fit(tmp_path):
    mixtrain.release_workers()
    folder = tmp_path / "user_code"
    folder.mkdir()
    source = """
        import torch
        from torch import nn
        from mixtrain import Task

        def make_task():
            if {wide}:
                torch.set_default_dtype(torch.float64)  # process-wide: a new worker would not have it
            model = nn.Sequential(nn.Linear(20, {hidden}), nn.Tanh(), nn.Linear({hidden}, 5)){cast}
            return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        loss_fn=nn.functional.cross_entropy)
    """
    module = folder / "edited_model.py"
    module.write_text(textwrap.dedent(source.format(hidden=8, wide=True, cast=".float()")))
    first = _fit(tmp_path, "first", from_module(str(folder), "edited_model"))
    assert first.state_dict["0.weight"].shape == (8, 20)
    module.write_text(textwrap.dedent(source.format(hidden=12, wide=False, cast="")))  # the user edits the file
    second = _fit(tmp_path, "second", from_module(str(folder), "edited_model"))
    assert _pids(second) == _pids(first)
    assert second.state_dict["0.weight"].shape == (12, 20)  # the edit is seen, as by new workers
    # the first task switched the workers' default dtype to float64; the kept workers went back to float32
    assert second.state_dict["0.weight"].dtype == torch.float32


def test_other_workers_a_dead_kept_worker_or_a_failed_fit_start_new_workers(tmp_path):
    mixtrain.release_workers()
    x, y = data("mlp", NUM_SAMPLES)
    want = reference("mlp", "sgd", x, y)
    two = _fit(tmp_path, "two")
    three = _fit(tmp_path, "three", num_workers=3)  # other workers: the kept pair is freed first
    assert not set(_pids(three)) & set(_pids(two))
    assert warm_workers.kept() == 3
    os.kill(_pids(three)[1], signal.SIGKILL)  # a kept worker dies while idle
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{_pids(three)[1]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    again = _fit(tmp_path, "again", num_workers=3)
    assert not set(_pids(again)) & set(_pids(three))  # the set did not answer: all new
    assert_same_weights(again.state_dict, want)
    with pytest.raises(mixtrain.WorkerError):
        _fit(tmp_path, "fails", raising_factory, num_workers=3)
    assert warm_workers.kept() == 0  # a fit that failed keeps nothing
    unkept = _fit(tmp_path, "unkept", num_workers=3, keep=False)
    assert warm_workers.kept() == 0
    assert_same_weights(unkept.state_dict, want)


def test_a_worker_the_plan_leaves_out_is_kept_with_the_others(tmp_path):
    """Worker 1 of 3 is far too slow (emulated, as in test_balancing): the plan leaves it out at start. It idles
    until the run ends and is kept with the two that trained, so the next fit starts no process either. Every
    sample costs 2 ms asleep on every worker, so that no load makes one of the two look worth leaving out."""
    mixtrain.release_workers()
    x, y = data("mlp", NUM_SAMPLES)
    scaling = ScalingConfig(num_workers=3, cpus_per_worker=0.5, keep_workers=True, emulate_slowdown={1: 600000.0})
    logs = []
    for name in ("first", "second"):
        result = Trainer(
            functools.partial(paced_task, "mlp", "sgd", 0.002),
            (x, y),
            global_batch=GLOBAL_BATCH,
            scaling=scaling,
            run=RunConfig(run_dir=str(tmp_path / name), seed=SEED, progress=False),
        ).fit(epochs=1)
        assert [w["rank"] for w in result.workers] == [0, 1], result.workers  # one of three left out
        assert warm_workers.kept() == 3
        logs.append(sorted(p.name for p in (tmp_path / name / "logs").iterdir()))
        assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))
    assert logs[0] == logs[1] and len(logs[0]) == 3, logs  # worker-RANK-cpu-pidPID.log: the same three processes


def test_kept_workers_serve_at_most_the_configured_number_of_fits(tmp_path, monkeypatch):
    mixtrain.release_workers()
    monkeypatch.setenv("MIXTRAIN_KEEP_WORKERS_MAX_FITS", "2")
    pids = [_pids(_fit(tmp_path, name)) for name in ("one", "two", "three")]
    assert pids[1] == pids[0] and not set(pids[2]) & set(pids[0]), pids  # served 2 fits, then new ones


def test_a_worker_left_out_mid_run_and_confirmed_is_kept_with_the_others(tmp_path, monkeypatch):
    """Worker 1 turns 100x slower from round 2 (as in test_balancing): the measured pair is slower than worker 0
    alone, so it is left out at a round boundary, parked, and let go once the wall clock confirms the call. Let
    go means out of the run, not out of the pool: the next fit takes the same two processes."""
    from tests.ray.test_balancing import _paced_task

    mixtrain.release_workers()
    monkeypatch.setenv("MIXTRAIN_EXCLUDE_GAIN", "100")  # never left out at start: only the measured check acts
    x, y = data("mlp", NUM_SAMPLES)
    scaling = ScalingConfig(num_workers=2, cpus_per_worker=0.5, keep_workers=True, emulate_slowdown={1: (100.0, 2)})
    results = []
    for name in ("first", "second"):
        run_dir = tmp_path / name
        trainer = Trainer(
            _paced_task(run_dir, 0.001),
            (x, y),
            global_batch=GLOBAL_BATCH,
            scaling=scaling,
            run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=2, progress=False),
        )
        results.append(result := trainer.fit(epochs=1))
        [gone], [confirmed] = run_records(run_dir, "left_out"), run_records(run_dir, "leave_out_confirmed")
        assert gone["worker"]["rank"] == 1 and gone["after_round"] < confirmed["after_round"], (gone, confirmed)
        assert warm_workers.kept() == 2
        assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))
    assert _pids(results[1]) == _pids(results[0])
