"""MLflow, W&B (offline) and TensorBoard loggers on one real run (Ray workers, gloo), each read back from the
store its own library wrote; a fourth logger whose store cannot be written is reported once and costs nothing."""

from __future__ import annotations

import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from tests.conftest import run_records
from tests.models import data, factory
from tests.trackers import (
    mlflow_artifacts,
    mlflow_run,
    mlflow_steps,
    needs_mlflow,
    needs_wandb,
    tensorboard_scalars,
    wandb_run,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), needs_mlflow, needs_wandb]

GLOBAL_BATCH = 64
NUM_SAMPLES = 64 * 8  # 8 steps an epoch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two epochs of the MLP on 2 workers, evaluated at each epoch's end, with all three loggers and a broken one."""
    from mixtrain.loggers import MLflowLogger, WandbLogger

    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    tmp = tmp_path_factory.mktemp("loggers")
    (tmp / "a-file").write_text("")
    x, y = data("mlp", NUM_SAMPLES)
    result = Trainer(
        factory("mlp", "sgd"),
        (x, y),
        eval_data=data("mlp", 128, seed=2),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp / "run"), seed=3, steps_per_round=4, progress=False, tensorboard=True),
        callbacks=[
            MLflowLogger(experiment="digits"),
            WandbLogger(project="mixtrain-tests"),
            MLflowLogger(tracking_uri=f"sqlite:///{tmp}/a-file/mlflow.db"),  # under a file: fails even as root
        ],
    ).fit(epochs=2)
    yield result
    mp.undo()


def test_mlflow_store_in_the_run_folder_holds_params_metrics_at_global_steps_and_artifacts(run):
    rounds, evals = run_records(run.run_dir, "round"), run_records(run.run_dir, "eval")
    client, mlrun = mlflow_run(f"sqlite:///{run.run_dir}/mlflow.db", "digits")
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == run.run_dir.name
    params = mlrun.data.params
    assert params["global_batch"] == "64" and params["scaling.num_workers"] == "2" and params["epochs"] == "2"
    assert params["strategy.name"] == "allreduce" and params["run.seed"] == "3"
    ends = [r["epoch"] * 8 + r["first_step"] + r["num_steps"] for r in rounds]
    assert mlflow_steps(client, mlrun, "train/loss") == [(s, pytest.approx(r["loss"])) for s, r in zip(ends, rounds)]
    assert mlflow_steps(client, mlrun, "train/lr/group0") == [
        (s, pytest.approx(r["lr"][0])) for s, r in zip(ends, rounds)
    ]
    accuracy = mlflow_steps(client, mlrun, "held_out/accuracy")
    assert accuracy == [(8, pytest.approx(evals[0]["accuracy"])), (16, pytest.approx(evals[1]["accuracy"]))]
    files = mlflow_artifacts(client, mlrun)
    assert {"run/config.json", "run/metrics.jsonl", "report/summary.txt", "report/loss.png"} <= set(files)
    assert "model/model.safetensors" in files and (run.run_dir / "mlartifacts").is_dir()


def test_wandb_offline_run_in_the_run_folder_holds_the_config_and_the_metrics(run):
    rounds, evals = run_records(run.run_dir, "round"), run_records(run.run_dir, "eval")
    wb = wandb_run(run.run_dir)
    assert wb["project"] == "mixtrain-tests" and wb["exit_code"] == 0
    assert wb["config"]["global_batch"] == 64 and wb["config"]["scaling"]["num_workers"] == 2
    assert [h["train/loss"] for h in wb["history"] if "train/loss" in h] == pytest.approx([r["loss"] for r in rounds])
    held_out = [(h["global_step"], h["held_out/accuracy"]) for h in wb["history"] if "held_out/accuracy" in h]
    assert held_out == [(8, pytest.approx(evals[0]["accuracy"])), (16, pytest.approx(evals[1]["accuracy"]))]


def test_tensorboard_from_run_config_has_the_learning_rate_at_the_samples_seen(run):
    scalars = tensorboard_scalars(run.run_dir / "tensorboard")
    rounds = run_records(run.run_dir, "round")
    assert [v for _, v in scalars["train/lr/group0"]] == pytest.approx([r["lr"][0] for r in rounds])
    assert [s for s, _ in scalars["held_out/accuracy"]] == [NUM_SAMPLES, 2 * NUM_SAMPLES]
    assert len([t for t in scalars if t.startswith("share/cpu_on_")]) == 2


def test_a_logger_that_cannot_write_is_reported_once_and_the_run_finishes(run):
    [error] = run_records(run.run_dir, "callback_error")
    assert error["callback"] == "MLflowLogger" and error["hook"] == "on_run_start"
    assert run.model_path.is_file() and len(run.evals) == 2
