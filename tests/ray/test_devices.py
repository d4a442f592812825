"""Device groups end to end on the shared local Ray: per-group precision, the numerics check
(warn and strict), preflight refusing a device the node does not have."""

from __future__ import annotations

import json

import pytest

from mixtrain import DeviceGroup, RunConfig, ScalingConfig, Trainer
from mixtrain.group.preflight import PreflightError
from tests.conftest import run_records
from tests.models import data, factory
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def _fit(tmp_path, groups, **scaling):
    x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        factory("mlp", "sgd"),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(groups=groups, **scaling),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=10, progress=False),
    )
    return trainer.fit(epochs=1), (x, y)


def test_strict_numerics_check_leaves_out_the_disagreeing_device_and_training_stays_exact(tmp_path):
    # Worker 2 computes in bf16 (real low-precision kernels); with a tight tolerance its gradient
    # disagrees with the CPU's fp32 one, so strict mode leaves it out before the group forms.
    groups = [DeviceGroup(device="cpu", num_workers=2), DeviceGroup(device="cpu", precision="bf16")]
    result, (x, y) = _fit(tmp_path, groups, numerics_check="strict", numerics_tolerance=1e-4, shares=[30, 20, 14])
    [pre] = run_records(result.run_dir, "preflight")
    assert pre["left_out"] == [{"rank": 2, "reason": "failed the numerics check (strict)"}]
    errors = {r["rank"]: r["error"] for r in pre["numerics"]}
    assert errors[0] == 0.0 and errors[1] == 0.0 and 1e-4 < errors[2] < 6e-2
    assert [w["rank"] for w in result.workers] == [0, 1]
    assert [w["precision"] for w in result.workers] == ["fp32", "fp32"]
    # The fixed shares of the two that stayed (30, 20) are rescaled to the global batch.
    config = json.loads((result.run_dir / "config.json").read_text())
    assert config["shares"] == [38, 26]
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_warn_mode_reports_and_keeps_a_bf16_worker_that_still_trains(tmp_path):
    groups = [DeviceGroup(device="cpu"), DeviceGroup(device="cpu", precision="bf16")]
    # leave_out_slow=False: bf16 on a CPU is slow, and this test is about keeping it
    result, _ = _fit(tmp_path, groups, numerics_tolerance=1e-4, leave_out_slow=False)
    [pre] = run_records(result.run_dir, "preflight")
    assert pre["left_out"] == [] and pre["numerics"][1]["error"] > 1e-4
    assert [w["precision"] for w in result.workers] == ["fp32", "bf16"]
    losses = [r["last_loss"] for r in result.history]
    assert losses[-1] < losses[0]


def test_a_worker_asking_for_a_gpu_on_a_cpu_node_fails_preflight_with_the_table(tmp_path):
    # Asking for no GPU resource (GPU: 0) lets Ray place the actor on this GPU-less machine;
    # the worker then finds no CUDA device where it landed, and preflight names it.
    groups = [DeviceGroup(device="cpu"), DeviceGroup(device="cuda", resources_per_worker={"GPU": 0})]
    with pytest.raises(PreflightError) as err:
        _fit(tmp_path, groups)
    text = str(err.value)
    assert "worker 1 on" in text and "asked for a cuda device but torch on its node reports none" in text
    assert "MISSING cuda" in text and "nothing was trained" in text


def test_workers_run_at_the_priority_of_the_command_that_started_them():
    # Ray's default puts workers 15 steps below it: beside any ordinary process on the same core they got 3% of it
    import os

    import ray

    from mixtrain.cluster.connect import system_env

    @ray.remote
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)  # `nice -n 10 mixtrain ...`: 10 (checked by hand)
    assert system_env()["RAY_worker_niceness"] == "0"  # `mixtrain cluster up/join` start Ray with it too
