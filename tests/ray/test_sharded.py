"""Optimizer state sharded by memory (ScalingConfig.shard_optimizer): the same training as one AdamW, each
worker holding only its slice; a checkpoint holds the whole state and resumes on another number of workers;
a lost worker's slice is recovered from the last checkpoint."""

import functools

import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from tests.conftest import run_records
from tests.models import data, factory, faulty_task
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def fit(task, run_dir, *, workers=3, shard=True, shares="auto", epochs=1, resume=None, **run):
    x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(
            num_workers=workers, cpus_per_worker=0.5, shares=shares, shard_optimizer=shard, leave_out_slow=False
        ),
        run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=2, progress=False, **run),
    )
    return trainer.fit(epochs=epochs, resume=resume), (x, y)


def test_sharded_adamw_with_unequal_slices_trains_exactly_like_one_adamw(tmp_path):
    result, (x, y) = fit(factory("mlp", "adamw"), tmp_path / "run", shard=[3, 1, 2], shares=[30, 20, 14])
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    held = [w["state_bytes"]["optimizer"] for w in result.history[-1]["workers"]]
    weights = result.history[-1]["workers"][0]["state_bytes"]["weights"]
    # AdamW keeps two moments per weight (and a step count per parameter): 2x the weights, split three ways
    assert 2 * weights <= sum(held) <= 2 * weights + 64, held
    assert all(0 < h < sum(held) / 1.5 for h in held), held
    assert held[0] > held[2] > held[1], held  # slices sized 3 : 1 : 2 (whole parameters, so roughly)


def test_a_lost_worker_takes_its_slice_along_and_training_goes_on_from_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    task = functools.partial(faulty_task, "mlp", "adamw", "kill", 1, 12, str(tmp_path / "fired"))
    result, (x, y) = fit(task, tmp_path / "run", checkpoint_every_s=0, rejoin=False)
    [rewound] = run_records(result.run_dir, "rewound")
    assert (rewound["epoch"], rewound["step"]) == (0, 10), rewound  # the checkpoint after the round of steps 8-9
    assert len(result.history[-1]["shares"]) == 2
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))


def test_a_sharded_checkpoint_resumes_on_another_number_of_workers_exactly(tmp_path):
    first, _ = fit(factory("mlp", "adamw"), tmp_path / "run", workers=3)
    resumed, _ = fit(factory("mlp", "adamw"), tmp_path / "run", workers=2, epochs=2, resume=first.run_dir)
    straight, _ = fit(factory("mlp", "adamw"), tmp_path / "straight", workers=2, shard=False, epochs=2)
    assert resumed.history[0]["epoch"] == 1
    assert_same_weights(resumed.state_dict, straight.state_dict, rtol=1e-6)
