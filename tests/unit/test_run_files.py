"""A run folder's files are opened one way (_files.RunFolder): no link followed at any level, no pipe or device
opened for good, bounded reads, new files 0600 and folders 0700. Each planted link leaves its target as it was;
each planted pipe ends in one clear error within seconds, never a hang."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mixtrain._files import RunFolder
from mixtrain.errors import InputValueError
from mixtrain.observe import worker_log
from mixtrain.observe.report import read_run
from mixtrain.observe.runlog import RunLog
from tests.trackers import mlflow_artifacts, mlflow_run, needs_mlflow, needs_wandb

SECRET = "a stand-in secret\n"
DEADLINE_S = 10.0


def within(fn: Callable[[], Any], timeout_s: float = DEADLINE_S) -> Any:
    """fn()'s result or exception, failing the test when it takes longer (a blocked open of a pipe never returns:
    the thread is left behind as a daemon)."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still blocked after {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    path.chmod(0o644)
    return path


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


# ---- the mechanism -------------------------------------------------------------------------------------
def test_new_files_are_0600_and_new_folders_0700_at_every_level(run):
    with RunFolder(run) as folder:
        folder.write_json("a/b/c.json", {"x": 1})
        with folder.append("logs/w.log") as f:
            f.write("line\n")
        folder.folder("tensorboard")
        assert folder.read_json("a/b/c.json") == {"x": 1}
    assert _mode(run / "a") == _mode(run / "a" / "b") == _mode(run / "logs") == _mode(run / "tensorboard") == 0o700
    assert _mode(run / "a" / "b" / "c.json") == _mode(run / "logs" / "w.log") == 0o600


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "", "a//b", "./x"])
def test_a_name_that_leaves_the_folder_is_refused(run, name):
    with RunFolder(run) as folder, pytest.raises(InputValueError, match="not a name inside a run folder"):
        folder.read(name)


@pytest.mark.parametrize("where", ["file", "folder"])
def test_a_link_at_any_level_is_not_followed_and_its_target_is_unchanged(run, secret, where):
    if where == "file":
        (run / "logs").mkdir()
        (run / "logs" / "w.log").symlink_to(secret)
    else:
        (run / "logs").symlink_to(secret.parent)
        (secret.parent / "w.log").write_text(SECRET)
    before = {p.name: p.read_text() for p in secret.parent.iterdir()}
    with RunFolder(run) as folder:
        for act in (lambda: folder.read("logs/w.log"), lambda: folder.append("logs/w.log").write("planted\n")):
            with pytest.raises(InputValueError, match="symbolic link"):
                act()
    assert {p.name: p.read_text() for p in secret.parent.iterdir()} == before


def test_a_dangling_link_is_refused_and_nothing_is_made_at_its_target(run, tmp_path):
    (run / "metrics.jsonl").symlink_to(tmp_path / "made-by-a-link")
    with RunFolder(run) as folder, pytest.raises(InputValueError, match="symbolic link"):
        folder.append("metrics.jsonl")
    assert not (tmp_path / "made-by-a-link").exists()


def test_a_pipe_or_a_folder_where_a_file_belongs_is_one_error_without_blocking(run):
    os.mkfifo(run / "metrics.jsonl")
    (run / "config.json").mkdir()
    with RunFolder(run) as folder:
        for name in ("metrics.jsonl", "config.json"):
            for act in (lambda n=name: folder.read(n), lambda n=name: folder.append(n)):
                with pytest.raises(InputValueError, match="not a regular file"):
                    within(act)


def test_a_read_is_bounded(run, monkeypatch):
    (run / "config.json").write_bytes(b" " * (2 << 20))
    monkeypatch.setenv("MIXTRAIN_RUN_FILE_MAX_MB", "1")
    with RunFolder(run) as folder, pytest.raises(InputValueError, match="MIXTRAIN_RUN_FILE_MAX_MB"):
        folder.read("config.json")


# ---- its users ------------------------------------------------------------------------------------------
def test_a_resume_does_not_append_metrics_through_a_planted_link(run, secret):
    (run / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(InputValueError, match=r"metrics\.jsonl is a symbolic link"):
        RunLog(run, {"run_id": "x"})
    assert secret.read_text() == SECRET


def test_config_json_planted_as_a_link_is_replaced_not_written_through(run, secret):
    (run / "config.json").symlink_to(secret)
    RunLog(run, {"run_id": "x"}).close()
    assert secret.read_text() == SECRET and not (run / "config.json").is_symlink()
    assert _mode(run / "config.json") == _mode(run / "metrics.jsonl") == 0o600


def test_a_pipe_planted_at_metrics_jsonl_is_refused_within_seconds(run):
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(InputValueError, match="named pipe"):
        within(lambda: RunLog(run, {"run_id": "x"}))


@pytest.mark.parametrize("plant", ["logs", "file", "fifo"])
def test_a_workers_log_is_never_opened_through_a_link_or_a_pipe(run, secret, plant):
    logs = run / "logs"
    if plant == "logs":
        logs.symlink_to(secret.parent)
    else:
        logs.mkdir()
        os.mkfifo(logs / "w.log") if plant == "fifo" else (logs / "w.log").symlink_to(secret)
    with pytest.raises(InputValueError):
        within(lambda: worker_log.open_log(worker_log.log_path(str(logs), "node", "node", "w.log")))
    assert secret.read_text() == SECRET and os.listdir(secret.parent) == ["secret.txt"]


def test_a_tensorboard_folder_planted_as_a_link_is_refused(run, secret):
    pytest.importorskip("tensorboardX")
    from mixtrain.loggers import TensorBoardLogger
    from tests.unit.test_loggers import started

    (run / "tensorboard").symlink_to(secret.parent)
    with pytest.raises(InputValueError, match="tensorboard is a symbolic link"):
        TensorBoardLogger().on_run_start(started(run))
    assert os.listdir(secret.parent) == ["secret.txt"]


@pytest.mark.parametrize("plant", ["link", "fifo", "huge"])
def test_the_reports_inputs_are_read_one_way(run, secret, plant, monkeypatch):
    (run / "config.json").write_text("{}")
    if plant == "link":
        (run / "metrics.jsonl").symlink_to(secret)
    elif plant == "fifo":
        os.mkfifo(run / "metrics.jsonl")
    else:
        monkeypatch.setenv("MIXTRAIN_RUN_FILE_MAX_MB", "1")
        (run / "metrics.jsonl").write_bytes(b"\n" * (2 << 20))
    with pytest.raises(InputValueError, match=r"metrics\.jsonl"):
        within(lambda: read_run(run))


@needs_mlflow
def test_mlflow_copies_no_linked_file_and_its_artifacts_are_private(run, secret, monkeypatch):
    from mixtrain.callbacks import RunEnded
    from mixtrain.driver.hooks import Hooks
    from mixtrain.loggers import MLflowLogger
    from tests.unit.test_loggers import FakeResult, started

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (run / "config.json").symlink_to(secret)
    (run / "metrics.jsonl").write_text("")
    (run / "model.safetensors").write_bytes(b"weights")
    lines: list[str] = []
    hooks = Hooks([MLflowLogger()], say=lines.append)
    hooks.run_started(started(run))
    hooks.run_ended(RunEnded(run, FakeResult(run / "model.safetensors"), None))
    assert len(lines) == 1 and "config.json is a symbolic link" in lines[0], lines  # said once; the rest logged
    client, logged = mlflow_run(f"sqlite:///{run}/mlflow.db")
    assert mlflow_artifacts(client, logged) == ["model/model.safetensors", "run/metrics.jsonl"]
    copies = [Path(d, f) for d, _, files in os.walk(run / "mlartifacts") for f in files]
    assert copies and all(_mode(p) == 0o600 and p.read_bytes() != SECRET.encode() for p in copies)
    assert _mode(run / "mlflow.db") == 0o600


@needs_mlflow
def test_an_mlflow_store_with_a_link_planted_in_its_artifacts_is_not_written_through(run, secret, monkeypatch):
    from mixtrain.loggers._mlflow import MLflowLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (run / "mlartifacts").mkdir()
    (run / "mlartifacts" / "1").symlink_to(secret.parent)
    with pytest.raises(InputValueError, match="symbolic link"):
        MLflowLogger().store_uri(run)
    assert os.listdir(secret.parent) == ["secret.txt"]


@needs_wandb
def test_a_wandb_folder_planted_as_a_link_is_refused(run, secret, monkeypatch):
    from mixtrain.loggers import WandbLogger
    from tests.unit.test_loggers import started

    monkeypatch.setenv("WANDB_MODE", "offline")
    (run / "wandb").symlink_to(secret.parent)
    with pytest.raises(InputValueError, match="wandb is a symbolic link"):
        WandbLogger(mode="offline").on_run_start(started(run))
    assert os.listdir(secret.parent) == ["secret.txt"]
