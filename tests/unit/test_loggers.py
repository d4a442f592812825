"""The loggers (mixtrain.loggers) fed the typed events directly, each writing to its real library's local store:
an MLflow SQLite store, a W&B offline run, TensorBoard event files. No Ray, no network."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mixtrain.callbacks import CheckpointSaved, Evaluated, RoundEnded, RunEnded, RunStarted
from mixtrain.config import RunConfig, ScalingConfig
from mixtrain.driver.hooks import Hooks
from mixtrain.errors import MissingExtraError
from tests.trackers import (
    mlflow_artifacts,
    mlflow_run,
    mlflow_steps,
    needs_mlflow,
    needs_wandb,
    tensorboard_scalars,
    wandb_run,
)

LOSSES = [(2, 1.0), (4, 0.9), (6, pytest.approx(0.7)), (8, pytest.approx(0.6))]
"""(global step, training loss) of run_through's rounds."""
WORKERS = [{"worker": "cpu on box (pid 7)", "samples": 48}, {"worker": "cuda:0 on box (pid 8)", "samples": 80}]


def started(run_dir: Path, resumed: Path | None = None) -> RunStarted:
    config = {
        "run_id": "abc123def456",
        "scaling": ScalingConfig(num_workers=2),
        "run": RunConfig(run_dir=str(run_dir), seed=3),
        "global_batch": 32,
        "epochs": 2,
        "shares": [12, 20],
    }
    return RunStarted(run_dir, "abc123def456", config, 2, None, 4, 0, resumed)


def round_end(epoch: int, step: int, loss: float) -> RoundEnded:
    record = {"epoch": epoch, "first_step": step - 2, "num_steps": 2, "wall_s": 0.5, "workers": WORKERS}
    return RoundEnded(
        epoch, step, epoch * 4 + step, (epoch * 4 + step) * 32, loss, 256.0, [12, 20], 1.5, [0.1, 0.01], record
    )


def evaluated(epoch: int, accuracy: float) -> Evaluated:
    return Evaluated(epoch, 4, epoch * 4 + 4, (epoch + 1) * 128, {"loss": 0.5, "accuracy": accuracy})


class FakeResult:
    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path


def run_through(
    logger, run_dir: Path, error: BaseException | None = None, resumed: Path | None = None, epochs: int = 2
) -> None:
    """A two-epoch run's events, in the driver's order, through the real dispatcher (which would report an error)."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text("")
    weights = run_dir / "model.safetensors"
    weights.write_bytes(b"weights")
    lines: list[str] = []
    hooks = Hooks([logger], steps_per_epoch=4, num_samples=128, global_batch=32, say=lines.append)
    start = started(run_dir, resumed)
    hooks.run_started(replace(start, config={**start.config, "epochs": epochs}))
    for epoch in range(2):
        hooks.fire("on_round_end", round_end(epoch, 2, 1.0 - epoch * 0.3))
        hooks.fire("on_round_end", round_end(epoch, 4, 0.9 - epoch * 0.3))
        hooks.fire("on_checkpoint", CheckpointSaved(run_dir / "checkpoints" / "x", epoch + 1, 0, epoch * 4 + 4))
        hooks.fire("on_eval_end", evaluated(epoch, 0.8 + epoch * 0.1))
    hooks.run_ended(RunEnded(run_dir, None if error else FakeResult(weights), error))
    assert lines == [], lines  # no hook failed


@needs_mlflow
def test_mlflow_logs_params_metrics_at_the_global_step_artifacts_and_the_status(tmp_path, monkeypatch):
    from mixtrain.loggers import MLflowLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    run_through(MLflowLogger(), run_dir)  # the default store: in the run folder
    assert (run_dir / "mlflow.db").is_file()
    client, run = mlflow_run(f"sqlite:///{run_dir}/mlflow.db")
    params = run.data.params
    assert params["scaling.num_workers"] == "2" and params["run.seed"] == "3" and params["global_batch"] == "32"
    assert params["epochs"] == "2" and params["shares"] == "[12, 20]" and params["run.run_dir"] == str(run_dir)
    assert mlflow_steps(client, run, "train/loss") == LOSSES
    assert [s for s, _ in mlflow_steps(client, run, "train/lr/group1")] == [2, 4, 6, 8]
    assert mlflow_steps(client, run, "held_out/accuracy") == [(4, pytest.approx(0.8)), (8, pytest.approx(0.9))]
    assert mlflow_steps(client, run, "samples_per_s/cuda_0_on_box_pid_8")[0] == (2, 160.0)
    metrics = run.data.metrics.keys()
    assert {"train/grad_norm", "train/samples_per_s", "share/cpu_on_box_pid_7", "held_out/loss"} <= metrics
    assert mlflow_artifacts(client, run) == ["model/model.safetensors", "run/config.json", "run/metrics.jsonl"]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.tags["mixtrain.run_id"] == "abc123def456"
    assert run.data.tags["mixtrain.last_checkpoint"].endswith("checkpoints/x")


@needs_mlflow
def test_mlflow_a_failed_run_ends_failed_and_a_resumed_one_continues_its_mlflow_run(tmp_path, monkeypatch):
    from mixtrain.loggers import MLflowLogger

    uri = f"sqlite:///{tmp_path}/shared.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_through(MLflowLogger(experiment="e"), tmp_path / "run", error=RuntimeError("worker lost"))
    client, run = mlflow_run(uri, "e")
    assert run.info.status == "FAILED" and run.data.tags["mixtrain.error"] == "RuntimeError: worker lost"
    assert "model/model.safetensors" not in mlflow_artifacts(client, run)
    assert not (tmp_path / "run" / "mlflow.db").exists()  # $MLFLOW_TRACKING_URI wins over the run folder
    assert (tmp_path / "mlartifacts").is_dir() and not (Path.cwd() / "mlruns").exists()  # beside the store
    resumed = tmp_path / "run" / "checkpoints" / "x"
    run_through(MLflowLogger(experiment="e"), tmp_path / "run", resumed=resumed, epochs=3)
    client, again = mlflow_run(uri, "e")  # still one run: the same, continued
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert len(mlflow_steps(client, again, "train/loss")) == 8 and "mixtrain.resumed_from" in again.data.tags
    assert again.data.params["epochs"] == "2" and again.data.tags["mixtrain.resumed.epochs"] == "3"  # MLflow: fixed


@needs_wandb
def test_wandb_offline_run_holds_the_config_and_the_metrics_at_the_global_step(tmp_path, monkeypatch):
    from mixtrain.loggers import WandbLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    run_through(WandbLogger(project="p"), tmp_path / "run")
    run = wandb_run(tmp_path / "run")
    assert run["id"] == "abc123def456" and run["project"] == "p" and run["exit_code"] == 0
    assert run["config"]["scaling"]["num_workers"] == 2 and run["config"]["run"]["seed"] == 3
    assert run["config"]["global_batch"] == 32 and run["config"]["shares"] == [12, 20]
    loss = [(h["global_step"], h["train/loss"]) for h in run["history"] if "train/loss" in h]
    assert loss == LOSSES
    evals = [h for h in run["history"] if "held_out/accuracy" in h]
    acc = [(h["global_step"], h["samples_seen"], h["held_out/accuracy"]) for h in evals]
    assert acc == [(4, 128, pytest.approx(0.8)), (8, 256, pytest.approx(0.9))]
    assert {"train/lr/group0", "train/grad_norm", "share/cpu_on_box_pid_7"} <= set(run["history"][0])


@needs_wandb
def test_wandb_a_failed_run_exits_with_code_1(tmp_path):
    from mixtrain.loggers import WandbLogger

    run_through(WandbLogger(mode="offline", save_dir=tmp_path / "wb"), tmp_path / "run", error=RuntimeError("x"))
    run = wandb_run(tmp_path / "wb")
    assert run["exit_code"] == 1 and run["summary"]["error"] == "RuntimeError: x"


@needs_wandb
def test_wandb_online_without_an_api_key_fails_when_made_not_mid_run(tmp_path, monkeypatch):
    from mixtrain.errors import InputValueError
    from mixtrain.loggers import WandbLogger

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: never the real service
    with pytest.raises(InputValueError, match=r"no W&B API key is configured; run `wandb login`"):
        WandbLogger(mode="online")


@needs_wandb
def test_wandb_online_with_its_server_unreachable_costs_the_init_timeout_once(tmp_path, monkeypatch):
    from mixtrain.loggers import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port: refused at once, retried
    monkeypatch.setenv("MIXTRAIN_WANDB_INIT_TIMEOUT_S", "1")
    lines: list[str] = []
    hooks = Hooks([WandbLogger(mode="online")], say=lines.append)
    hooks.run_started(started(tmp_path))
    hooks.fire("on_round_end", round_end(0, 2, 1.0))
    hooks.run_ended(RunEnded(tmp_path, None, None))
    assert len(lines) == 1 and "WandbLogger.on_run_start raised" in lines[0], lines


def test_tensorboard_logger_writes_the_tags_at_the_samples_seen(tmp_path):
    from mixtrain.loggers import TensorBoardLogger

    run_through(TensorBoardLogger(), tmp_path / "run")
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [64, 128, 192, 256]
    assert scalars["held_out/accuracy"] == [(128, pytest.approx(0.8)), (256, pytest.approx(0.9))]
    assert [v for _, v in scalars["train/lr/group1"]] == pytest.approx([0.01] * 4)
    assert {"train/grad_norm", "samples_per_s/cpu_on_box_pid_7", "share/cuda_0_on_box_pid_8"} <= set(scalars)


@needs_mlflow
def test_a_logger_that_cannot_write_is_reported_once_and_the_run_goes_on(tmp_path):
    """An MLflow store under a file (unwritable even for root): the start fails, the dispatcher says so once,
    and the logger stays quiet for the rest of the run instead of failing at every round."""
    from mixtrain.loggers import MLflowLogger

    (tmp_path / "file").write_text("")
    lines: list[str] = []
    logger = MLflowLogger(tracking_uri=f"sqlite:///{tmp_path}/file/mlflow.db")
    hooks = Hooks([logger], say=lines.append)
    hooks.run_started(started(tmp_path))
    for step in (2, 4):
        hooks.fire("on_round_end", round_end(0, step, 1.0))
    hooks.fire("on_eval_end", evaluated(0, 0.5))
    hooks.run_ended(RunEnded(tmp_path, None, None))
    assert len(lines) == 1 and "callback MLflowLogger.on_run_start raised" in lines[0], lines
    assert hooks.errors == {("MLflowLogger", "on_run_start"): 1}


@pytest.mark.parametrize(("name", "module", "extra"), [("mlflow", "mlflow", "mlflow"), ("wandb", "wandb", "wandb")])
def test_a_missing_library_fails_when_the_logger_is_made_naming_the_extra(monkeypatch, name, module, extra):
    from mixtrain.loggers import by_name

    monkeypatch.setitem(sys.modules, module, None)  # import mlflow -> ImportError
    with pytest.raises(MissingExtraError, match=rf'needs .*pip install "mixtrain\[{extra}\]"'):
        by_name(name)


def test_tensorboard_logger_without_a_writer_names_the_extra(monkeypatch):
    from mixtrain.loggers import TensorBoardLogger

    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(MissingExtraError, match=r"mixtrain\[tensorboard\]"):
        TensorBoardLogger()


def test_the_extras_and_dev_name_the_libraries():
    tomllib = pytest.importorskip("tomllib")
    from tests.conftest import REPO

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("mlflow-skinny") for d in extras["mlflow"]) and extras["wandb"][0].startswith("wandb")
    assert set(extras["mlflow"]) | set(extras["wandb"]) <= set(extras["dev"])  # CI runs these tests, never skips


def test_cli_logger_flag_takes_names_repeated_or_with_commas_or_from_a_config_file(tmp_path):
    from mixtrain.cli.main import _parse, build_parser

    args = build_parser().parse_args(["train", "--logger", "mlflow,wandb", "--logger", "tensorboard"])
    assert args.logger == ["mlflow", "wandb", "tensorboard"]
    (tmp_path / "c.toml").write_text('task = "digits"\nlogger = ["mlflow", "wandb"]\n')
    args, _ = _parse(["train", "--config", str(tmp_path / "c.toml"), "--logger", "tensorboard"])
    assert args.logger == ["mlflow", "wandb", "tensorboard"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--logger", "neptune"])


@needs_mlflow
@needs_wandb
def test_cli_loggers_reach_the_trainer_once_each(tmp_path):
    from mixtrain.cli.main import _parse, _trainer

    args, _ = _parse(["train", "digits", "--logger", "mlflow,wandb", "--logger", "mlflow", "--workers", "1"])
    _, trainer = _trainer(args, str(tmp_path / "r"))
    assert [type(cb).__name__ for cb in trainer.callbacks] == ["MLflowLogger", "WandbLogger"]


def test_cli_a_missing_logger_library_is_one_line_before_ray_starts(tmp_path):
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['mlflow'] = None\n"
        "from mixtrain.cluster import connect\n"
        "connect.ensure_ray = lambda *a, **k: print('Ray started')\n"
        "from mixtrain.cli.main import main\n"
        "sys.exit(main(['train', 'digits', '--logger', 'mlflow', '--run-dir', sys.argv[1]]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "r")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "mixtrain: error: MLflowLogger (--logger mlflow) needs mlflow-skinny, which is not installed: pip install "
        '"mixtrain[mlflow]" (or pip install mlflow-skinny)'
    ]
    assert "Ray started" not in proc.stdout and not (tmp_path / "r").exists()


def test_run_config_tensorboard_adds_one_logger_after_the_users_callbacks_unless_one_is_given():
    from mixtrain import EarlyStopping, Trainer
    from mixtrain.loggers import TensorBoardLogger
    from tests.models import data, factory

    def made(tensorboard, callbacks=()):
        run = RunConfig(tensorboard=tensorboard, progress=False)
        trainer = Trainer(factory("mlp", "sgd"), data("mlp", 64), global_batch=32, run=run, callbacks=list(callbacks))
        return [type(cb).__name__ for cb in [*trainer.callbacks, *trainer._tensorboard()]]

    stop = EarlyStopping()
    assert made(None, [stop]) == made(True, [stop]) == ["EarlyStopping", "TensorBoardLogger"]  # tensorboardX: dev
    assert made(False, [stop]) == ["EarlyStopping"]
    assert made(True, [TensorBoardLogger(), stop]) == ["TensorBoardLogger", "EarlyStopping"]


# ---- issue 46: a tracker's run is picked by a run id read from the folder only when it looks like an id -----------


def test_run_ids_are_letters_and_digits_of_bounded_length():
    from mixtrain.callbacks import RUN_ID_MAX, is_run_id

    assert is_run_id("abc123def456") and is_run_id("A" * RUN_ID_MAX)
    for bad in ("", "A" * (RUN_ID_MAX + 1), "x' OR '1", "../run", "ab-c", "é1", None, 12):
        assert not is_run_id(bad), bad


def test_a_checkpoints_run_id_that_is_no_id_is_replaced_with_a_note():
    from mixtrain.trainer import _run_id

    meta = {"epoch": 0, "step": 1, "global_step": 1, "shares": [8], "num_workers": 1, "workers": []}
    notes: list[str] = []
    assert _run_id(({}, {**meta, "run_id": "abc123def456"}, Path("x")), notes) == "abc123def456" and not notes
    planted = "abc123def456' AND attributes.status = 'FAILED"
    new = _run_id(({}, {**meta, "run_id": planted}, Path("x")), notes)
    assert new != planted and len(new) == 12 and "is not letters and digits" in notes[0]


@needs_mlflow
def test_mlflow_never_puts_a_planted_run_id_into_its_search(tmp_path, monkeypatch):
    from mixtrain.loggers import MLflowLogger

    uri = f"sqlite:///{tmp_path}/shared.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_through(MLflowLogger(experiment="e"), tmp_path / "run", error=RuntimeError("worker lost"))
    _, first = mlflow_run(uri, "e")
    planted = "zzz' OR tags.`mixtrain.run_id` != 'zzz"  # would match every run of the experiment
    logger = MLflowLogger(experiment="e")
    start = replace(started(tmp_path / "run", resumed=tmp_path / "run" / "checkpoints" / "x"), run_id=planted)
    lines: list[str] = []
    Hooks([logger], say=lines.append).run_started(start)
    assert lines == [] and logger.run_id is not None and logger.run_id != first.info.run_id
