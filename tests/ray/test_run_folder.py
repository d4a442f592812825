"""A real run's folder: metrics with per-device memory and names, worker logs, TensorBoard event files,
and `report`'s plots and summary made from it."""

import struct

import numpy as np
import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from mixtrain.job import load_job
from mixtrain.observe.report import write_report
from tests.conftest import run_records
from tests.trackers import tensorboard_scalars

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Digits for 3 epochs on 2 workers, the second 3x slower from round 3 on, so the shares move."""
    path = tmp_path_factory.mktemp("run")
    job = load_job("digits")
    Trainer(
        job.task_factory,
        job.train_data,
        eval_data=job.eval_data,
        global_batch=job.global_batch,
        scaling=ScalingConfig(num_workers=2, emulate_slowdown={1: (3.0, 3)}, leave_out_slow=False),
        run=RunConfig(run_dir=str(path), steps_per_round=4, progress=False, tensorboard=True),
    ).fit(epochs=3)
    return path


def test_round_records_name_each_device_and_its_memory(run_dir):
    rounds = run_records(run_dir, "round")
    labels = {w["worker"] for r in rounds for w in r["workers"]}
    assert len(labels) == 2 and all(label.startswith("cpu on ") and "(pid " in label for label in labels)
    assert all(w["memory_bytes"] > 10 * 2**20 for r in rounds for w in r["workers"])  # the RSS of a torch process
    assert len({tuple(r["shares"]) for r in rounds}) > 1


def test_a_checkpoint_precedes_every_evaluation(run_dir):
    """A worker lost while evaluating must not cost the epoch: every evaluation has its epoch-end checkpoint."""
    evals = [r["epoch"] for r in run_records(run_dir, "eval")]
    checkpoints = {(r["epoch"], r["step"]) for r in run_records(run_dir, "checkpoint")}
    assert evals == [0, 1, 2]
    assert all((e + 1, 0) in checkpoints for e in evals), checkpoints


def test_without_held_out_data_epochs_end_without_a_checkpoint_until_the_last(tmp_path):
    """Epochs of a small data set take well under a second on a GPU: a checkpoint at each cost 13% of training
    in the GPU check. Without an evaluation to protect, only the last epoch end (and checkpoint_every_s) writes."""
    from tests.models import data, factory

    x, y = data("mlp", 64 * 4)
    Trainer(
        factory("mlp", "sgd"),
        (x, y),
        global_batch=64,
        scaling=ScalingConfig(num_workers=1),
        run=RunConfig(run_dir=str(tmp_path / "run"), progress=False, tensorboard=False),
    ).fit(epochs=3)
    assert [r["global_step"] for r in run_records(tmp_path / "run", "checkpoint")] == [12]


def test_worker_output_goes_to_the_run_folder(run_dir):
    logs = sorted((run_dir / "logs").glob("worker-*.log"))
    assert [p.name.split("-")[1] for p in logs] == ["0", "1"]
    for path in logs:
        text = path.read_text()
        assert "asking for cpu" in text and "epoch 2 steps" in text


def test_tensorboard_event_files_hold_loss_held_out_metrics_and_per_device_speed(run_dir):
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    evals = run_records(run_dir, "eval")
    assert [v for _, v in scalars["held_out/accuracy"]] == pytest.approx([e["accuracy"] for e in evals])
    assert [s for s, _ in scalars["held_out/accuracy"]] == [1438, 2876, 4314]  # samples seen at each epoch end
    assert len(scalars["train/loss"]) == len(run_records(run_dir, "round"))
    assert len([t for t in scalars if t.startswith("samples_per_s/cpu_on_")]) == 2  # cpu_on_HOST_pid_N
    assert len([t for t in scalars if t.startswith("share/cpu_on_")]) == 2


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_writes_readable_pngs_with_the_expected_panels_and_a_summary(run_dir, tmp_path):
    import matplotlib.image

    report = write_report(run_dir, tmp_path)
    assert sorted(p.name for p in report.files) == ["loss.png", "shares.png", "summary.txt", "throughput.png"]
    assert report.panels == {
        "loss.png": ["Loss vs. samples seen", "Held-out accuracy vs. samples seen"],
        "throughput.png": ["Samples/s per device over time (one segment per round)"],
        "shares.png": ["Share of the global batch per device over time"],
    }
    for name in report.panels:
        width, height = _png_size(tmp_path / name)
        assert width >= 1000 and height >= 400
        pixels = matplotlib.image.imread(tmp_path / name)
        assert np.std(pixels[..., :3]) > 0.05  # drawn on, not blank
    summary = (tmp_path / "summary.txt").read_text()
    evals = run_records(run_dir, "eval")
    assert f"accuracy {evals[-1]['accuracy']:.4f}" in summary and "reached epoch 3 of 3" in summary
    assert summary.count("cpu on ") == 2 and "3 checkpoints written" in summary
