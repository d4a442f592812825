"""Optimizer state sharded by memory (ScalingConfig.shard_optimizer): the same training as one AdamW, each
worker holding only its slice; a checkpoint holds the whole state and resumes on another number of workers;
a lost worker's slice is recovered from the last checkpoint."""

import dataclasses
import functools
import json

import pytest
import torch

from mixtrain import DeviceGroup, RunConfig, ScalingConfig, Trainer
from mixtrain.errors import InputValueError
from mixtrain.group.group_calls import WorkerError
from mixtrain.policies.memory_plan import PROCESS_BYTES
from tests.conftest import run_records
from tests.models import data, factory, faulty_task, make_task
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def fit(task, run_dir, *, workers=3, shard="optimizer", slices=None, shares="auto", epochs=1, resume=None, **kw):
    x, y = data("mlp", NUM_SAMPLES)
    micro = kw.pop("max_micro_batch", None)
    offload = kw.pop("offload", "none")
    trainer = Trainer(
        task,
        (x, y),
        eval_data=kw.pop("eval_data", None),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(
            num_workers=workers,
            cpus_per_worker=0.5,
            shares=shares,
            shard=shard,
            shard_slices=slices,
            leave_out_slow=False,
            max_micro_batch=micro,
            offload=offload,
        ),
        run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=2, progress=False, **kw),
    )
    return trainer.fit(epochs=epochs, resume=resume), (x, y)


def test_sharded_adamw_with_unequal_slices_trains_exactly_like_one_adamw(tmp_path):
    result, (x, y) = fit(factory("mlp", "adamw"), tmp_path / "run", slices=[3, 1, 2], shares=[30, 20, 14])
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    held = [w["state_bytes"]["optimizer"] for w in result.history[-1]["workers"]]
    weights = result.history[-1]["workers"][0]["state_bytes"]["weights"]
    # AdamW keeps two moments per weight (and a step count per parameter): 2x the weights, split three ways
    assert 2 * weights <= sum(held) <= 2 * weights + 64, held
    assert all(0 < h < sum(held) / 1.5 for h in held), held
    assert held[0] > held[2] > held[1], held  # slices sized 3 : 1 : 2 (whole parameters, so roughly)


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_a_lost_worker_takes_its_slice_along_and_goes_on_from_the_last_checkpoint(tmp_path, monkeypatch, shard):
    """Its slice of the optimizer state (and at "full", of the weights) exists nowhere else: the last checkpoint."""
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    task = functools.partial(faulty_task, "mlp", "adamw", "kill", 1, 12, str(tmp_path / "fired"))
    result, (x, y) = fit(task, tmp_path / "run", shard=shard, checkpoint_every_s=0, rejoin=False)
    [rewound] = run_records(result.run_dir, "rewound")
    assert (rewound["epoch"], rewound["step"]) == (0, 10), rewound  # the checkpoint after the round of steps 8-9
    assert len(result.history[-1]["shares"]) == 2
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))


def test_a_sharded_checkpoint_resumes_on_another_number_of_workers_exactly(tmp_path):
    first, _ = fit(factory("mlp", "adamw"), tmp_path / "run", workers=3)
    resumed, _ = fit(factory("mlp", "adamw"), tmp_path / "run", workers=2, epochs=2, resume=first.run_dir)
    straight, _ = fit(factory("mlp", "adamw"), tmp_path / "straight", workers=2, shard="none", epochs=2)
    assert resumed.history[0]["epoch"] == 1
    assert_same_weights(resumed.state_dict, straight.state_dict, rtol=1e-6)


def test_full_slicing_trains_exactly_like_one_adamw_and_each_worker_holds_a_slice_of_the_weights(tmp_path):
    """shard="full": compute shares 30:20:14 (micro-batches of at most 8 and 16 on two of them: every worker
    runs as many passes, the third some idle ones), memory slices 3:1:2, held-out data evaluated in step."""
    ex, ey = data("mlp", 50, seed=3)
    result, (x, y) = fit(
        factory("mlp", "adamw"),
        tmp_path / "run",
        shard="full",
        slices=[3, 1, 2],
        shares=[30, 20, 14],
        max_micro_batch=[8, 16, None],
        eval_data=(ex, ey),
    )
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    held = result.history[-1]["workers"]
    whole = sum(v.numel() * v.element_size() for v in result.state_dict.values())
    weights = [w["state_bytes"]["weights"] for w in held]
    assert sum(weights) == whole and all(0 < w < whole / 1.5 for w in weights), (weights, whole)
    task = make_task("mlp", "adamw")
    task.model.load_state_dict(result.state_dict)
    with torch.no_grad():
        want = float(task.loss_fn(task.model(ex), ey))
    assert result.metrics["samples"] == 50 and result.metrics["loss"] == pytest.approx(want, rel=1e-5)


def test_gradients_slicing_with_the_optimizer_on_the_host_trains_exactly_like_one_sgd(tmp_path):
    result, (x, y) = fit(
        factory("mlp", "sgd"), tmp_path / "run", shard="gradients", shares=[40, 24], workers=2, offload="optimizer"
    )
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_a_full_checkpoint_resumes_replicated_and_back_exactly(tmp_path):
    """A run with sliced weights resumed on 2 workers holding everything (a bigger machine), and one of those
    resumed sliced again on 3: the same weights as 2 workers straight through."""
    first, _ = fit(factory("mlp", "adamw"), tmp_path / "run", shard="full")
    second, _ = fit(factory("mlp", "adamw"), tmp_path / "run", workers=2, shard="none", epochs=2, resume=first.run_dir)
    third, _ = fit(factory("mlp", "adamw"), tmp_path / "run", shard="full", epochs=3, resume=second.run_dir)
    straight, _ = fit(factory("mlp", "adamw"), tmp_path / "straight", workers=2, shard="none", epochs=3)
    assert (second.history[0]["epoch"], third.history[0]["epoch"]) == (1, 2)
    assert_same_weights(third.state_dict, straight.state_dict, rtol=1e-6)


def capped(task, run_dir, room: int, **kw):
    """shard="auto" on 2 CPU workers, each capped at a process's own bytes plus `room` for the training state."""
    x, y = data("mlp", NUM_SAMPLES)
    group = DeviceGroup(num_workers=2, resources_per_worker={"CPU": 0.5}, memory=PROCESS_BYTES["cpu"] + room)
    trainer = Trainer(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(groups=[group], shard="auto", leave_out_slow=False),
        run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=10, progress=False, **kw),
    )
    return trainer, (x, y)


def test_auto_slices_where_the_whole_state_does_not_fit_and_trains_exactly_like_one_adamw(tmp_path):
    """The MLP's state is 20.1 KiB whole (weights 5 KiB, gradients 5 KiB, AdamW 10 KiB), 15.2 KiB per worker at
    "gradients" (its largest Linear's gradients in backward included): a room of 17,000 bytes fits only that."""
    trainer, (x, y) = capped(factory("mlp", "adamw"), tmp_path / "run", 17_000)
    result = trainer.fit(epochs=1)
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    [preflight] = run_records(result.run_dir, "preflight")
    assert preflight["shard"]["level"] == "gradients", preflight["shard"]
    assert preflight["shard"]["reason"].startswith("shard auto: gradients, the lowest level whose training state")
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["scaling"]["shard"] == "gradients"  # what the probe, the strategy and the final gather read


def test_auto_keeps_everything_whole_where_it_fits_and_refuses_to_start_where_nothing_does(tmp_path):
    trainer, _ = capped(factory("mlp", "adamw"), tmp_path / "roomy", 2**30)
    up = trainer.plan()
    assert up.ops.group.scaling.shard == "none" and up.checks["shard"]["level"] == "none"
    assert any(note.startswith("shard auto: none, the lowest level") for note in up.notes), up.notes
    trainer, _ = capped(factory("mlp", "adamw"), tmp_path / "tight", 10_000)
    with pytest.raises(InputValueError, match=r"ScalingConfig.shard='auto': no level's training state fits"):
        trainer.fit(epochs=1)


def _named_blocks_task(blocks):
    return dataclasses.replace(make_task("mlp", "adamw"), shard_blocks=blocks)


def test_blocks_named_on_the_task_train_exactly_and_a_block_the_model_lacks_stops_before_training(tmp_path):
    result, (x, y) = fit(
        functools.partial(_named_blocks_task, (torch.nn.Linear,)), tmp_path / "run", shard="full", slices=[1, 2, 1]
    )
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    with pytest.raises(WorkerError, match=r"Task.shard_blocks: block='GPT2Block': the model has no module class"):
        fit(functools.partial(_named_blocks_task, ("GPT2Block",)), tmp_path / "bad", shard="full")
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_a_cpu_worker_whose_peak_passes_its_memory_cap_is_named_once_and_trains_on_exactly(tmp_path):
    """Nothing holds a CPU process to DeviceGroup(memory=...): 150 MB is below any worker's resident set, so each
    worker is named once (a record and a line), and the slices still follow the caps (equal here)."""
    x, y = data("mlp", NUM_SAMPLES)
    group = DeviceGroup(num_workers=2, resources_per_worker={"CPU": 0.5}, memory="150MB")
    result = Trainer(
        factory("mlp", "adamw"),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(groups=[group], shard="gradients", leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=2, progress=False),
    ).fit(epochs=1)
    assert_same_weights(result.state_dict, reference("mlp", "adamw", x, y))
    over = run_records(result.run_dir, "memory_over_cap")
    assert sorted(r["bundle"] for r in over) == [0, 1], over  # once each, over several rounds
    assert all(r["cap_bytes"] == 150 * 2**20 < r["peak_bytes"] for r in over), over
    assert len(result.history) > 2
