"""A run folder belongs to one run: reused folders are refused with the fix, default names never collide,
checkpoints are pruned in the order they were saved, and a resume refuses a changed batch or data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixtrain import RunConfig, Task, Trainer
from mixtrain.checkpoint import CheckpointMeta, CheckpointStore
from mixtrain.observe.runlog import make_run_dir


def _meta(step: int, **extra: object) -> dict:
    return {
        "epoch": 0,
        "step": step,
        "global_step": step,
        "shares": [32, 32],
        "num_workers": 2,
        "workers": [],
        **extra,
    }


def _save(store: CheckpointStore, step: int, **extra: object) -> Path:
    return store.save({"model": {"w": torch.full((2,), float(step))}, "epoch": 0}, _meta(step, **extra))


def test_a_folder_that_holds_a_run_is_refused_unless_resumed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "command.json").write_text("{}")
    assert make_run_dir(RunConfig(run_dir=str(run))) == run.resolve()  # flags only: no run happened there
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"already holds a run \(metrics.jsonl\).*--resume .*new --run-dir"):
        make_run_dir(RunConfig(run_dir=str(run)))
    assert make_run_dir(RunConfig(run_dir=str(run)), resuming=True) == run.resolve()
    named = tmp_path / "named"
    (named / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds a run"):
        make_run_dir(RunConfig(storage_path=str(tmp_path), name="named"))


def test_default_run_names_never_collide_even_in_the_same_second(tmp_path):
    folders = {make_run_dir(RunConfig(storage_path=str(tmp_path))) for _ in range(20)}
    assert len(folders) == 20 and all(f.is_dir() for f in folders)


def test_checkpoints_are_pruned_in_save_order_not_by_step_number(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (300, 310):
        _save(store, step)
    newest = _save(store, 12)  # a run went back to an earlier checkpoint and trains on from step 12
    assert store.paths()[0] == newest and newest.exists()
    assert [p.name for p in store.paths()] == ["step-000000012", "step-000000310"]
    _, manifest, path = store.latest()
    assert path == newest and manifest["saved_seq"] == 3


def test_the_manifest_records_the_run_the_batch_and_the_data(tmp_path):
    store = CheckpointStore(tmp_path)
    _save(store, 5, run_id="abc123", global_batch=64, num_samples=1000)
    meta = CheckpointMeta.from_manifest(store.latest()[1])
    assert (meta.run_id, meta.global_batch, meta.num_samples) == ("abc123", 64, 1000)
    _save(store, 6)  # a checkpoint from before these fields still loads, with unknown values
    assert CheckpointMeta.from_manifest(store.latest()[1]).global_batch == 0


def _task() -> Task:
    model = torch.nn.Linear(2, 2)
    return Task(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss
    )


def test_resuming_with_another_global_batch_is_refused_with_the_fix(tmp_path):
    _save(CheckpointStore(tmp_path / "run"), 5, global_batch=64, num_samples=1000)
    trainer = Trainer(_task, (torch.zeros(8, 2), torch.zeros(8, 2)), global_batch=128)
    with pytest.raises(ValueError, match=r"global_batch=64, this run asks for 128.*--global-batch 64"):
        trainer.fit(epochs=2, resume=tmp_path / "run")


def test_the_cli_refuses_a_run_folder_that_holds_a_run_before_touching_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "round"}\n')
    (run / "command.json").write_text('{"argv": ["digits"]}\n')
    cli = Path(sys.executable).parent / "mixtrain"
    proc = subprocess.run([str(cli), "train", "digits", "--run-dir", str(run)], capture_output=True, text=True)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "--resume" in proc.stderr
    assert json.loads((run / "command.json").read_text()) == {"argv": ["digits"]}  # untouched


# ---- issue 33: folders in the way give one clear error, never a hang ----------------------------------------
def _within(seconds: float, call):
    """call()'s exception (or None), or a failure if it has not returned in `seconds` (it hung)."""
    import threading

    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still running after {seconds} s (a hang)"
    return out[0]


def test_a_dangling_runs_link_gives_one_clear_error_and_no_hang(tmp_path):
    link = tmp_path / "mixtrain_runs"
    link.symlink_to(tmp_path / "gone")
    error = _within(10, lambda: make_run_dir(RunConfig(storage_path=str(link))))
    assert isinstance(error, ValueError), error
    assert f"RunConfig.storage_path='{link}'" in str(error) and "which does not exist" in str(error)
    assert "remove the link or create the folder it points to" in str(error)
    (tmp_path / "file").write_text("")
    error = _within(10, lambda: make_run_dir(RunConfig(run_dir=str(tmp_path / "file" / "run"))))
    assert isinstance(error, ValueError) and f"'{tmp_path / 'file'}' is not a folder" in str(error), error


def test_fit_with_the_default_run_folder_under_a_dangling_link_stops_at_once(tmp_path):
    # Trainer(...).fit() with the default RunConfig, in ./mixtrain_runs: a process, so a hang can be ended
    (tmp_path / "mixtrain_runs").symlink_to(tmp_path / "gone")
    code = (
        "import sys, torch\n"
        "from mixtrain import Trainer\n"
        "from tests.unit.test_run_folders import _task\n"
        "try:\n"
        "    Trainer(_task, (torch.zeros(8, 2), torch.zeros(8, 2)), global_batch=4).fit()\n"
        "except ValueError as exc:\n"
        "    sys.exit(f'ValueError: {exc}')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = [sys.executable, "-c", code]
    # (a hang would be the bug: 60 s, not 10, as importing torch alone took over 10 s on a loaded 2-core machine)
    proc = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "ValueError: RunConfig.storage_path='mixtrain_runs'" in proc.stderr, proc.stderr
    assert "symbolic link" in proc.stderr and not (tmp_path / "gone").exists()


def test_new_run_names_are_tried_a_bounded_number_of_times(tmp_path, monkeypatch):
    import mixtrain.observe.runlog as runlog

    monkeypatch.setattr(runlog, "new_run_name", lambda: "taken")
    (tmp_path / "taken").mkdir()
    error = _within(10, lambda: make_run_dir(RunConfig(storage_path=str(tmp_path))))
    assert isinstance(error, ValueError) and "new run names in a row already existed" in str(error), error


def test_a_checkpoints_link_in_a_run_folder_is_refused_before_anything_is_written(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ValueError, match=r"checkpoints folder is a symbolic link .*Replace the link by a folder"):
        make_run_dir(RunConfig(run_dir=str(run)), resuming=True)
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoints\)"):
        make_run_dir(RunConfig(run_dir=str(run)))
    with pytest.raises(ValueError, match="writes and deletes checkpoints only in a folder of the run"):
        _save(CheckpointStore(run), 2)
    assert os.listdir(elsewhere) == ["keep.txt"]


# ---- issue 33: a resume keeps the sample order: the same seed, the same data -----------------------------------
def _trainer(seed: int = 0, x: torch.Tensor | None = None) -> Trainer:
    x = torch.arange(16.0).reshape(8, 2) if x is None else x
    return Trainer(_task, (x, torch.zeros(8, 2)), global_batch=4, run=RunConfig(seed=seed))


def _checkpoint_of(trainer: Trainer, path: Path, step: int = 1, **meta: object) -> None:
    from mixtrain.trainer import _data_fingerprint

    fields = {"global_batch": 4, "num_samples": 8, "seed": 0, "data_fingerprint": _data_fingerprint(trainer.train_data)}
    CheckpointStore(path).save({"model": {"w": torch.zeros(2)}}, {**_meta(step), "global_step": 1, **fields, **meta})


def test_resuming_with_another_seed_is_refused_naming_both_and_the_fix(tmp_path):
    _checkpoint_of(_trainer(), tmp_path / "run", seed=0)
    with pytest.raises(
        ValueError, match=r"trained with seed 0, this run asks for RunConfig.seed=1;.*Resume with --seed 0 \(RunConfig"
    ):
        _trainer(seed=1)._load_resume(tmp_path / "run", 3, [])
    assert _trainer(seed=0)._load_resume(tmp_path / "run", 3, [])[2].name == "step-000000001"
    _checkpoint_of(_trainer(), tmp_path / "old", seed=None, data_fingerprint="")  # before seeds were recorded
    assert _trainer(seed=1)._load_resume(tmp_path / "old", 3, [])[2].name == "step-000000001"


def test_resuming_on_other_training_data_is_refused(tmp_path):
    _checkpoint_of(_trainer(), tmp_path / "run")
    other = _trainer(x=torch.arange(16.0).reshape(8, 2) * 2)  # as many samples, other values
    with pytest.raises(ValueError, match=r"trained on other training data .*Resume with the same training data"):
        other._load_resume(tmp_path / "run", 3, [])
    more = Trainer(_task, (torch.zeros(12, 2), torch.zeros(12, 2)), global_batch=4)
    with pytest.raises(ValueError, match=r"trained on 8 samples per epoch, the data now has 12"):
        more._load_resume(tmp_path / "run", 3, [])


def test_a_checkpoint_without_its_batch_and_data_still_cannot_resume_past_the_epoch(tmp_path):
    _checkpoint_of(_trainer(), tmp_path / "run", global_batch=0, num_samples=0, step=99)
    with pytest.raises(ValueError, match=r"continues at step 99 of epoch 0, but an epoch of 8 samples has 2 steps"):
        _trainer()._load_resume(tmp_path / "run", 3, [])


def test_the_cli_refuses_a_resume_with_another_seed_in_one_line_before_ray(tmp_path, capsys, monkeypatch):
    from mixtrain.cli.main import main
    from mixtrain.signing import sign

    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    _save(CheckpointStore(run), 1, seed=0)  # batch and data unknown: only the seed decides
    (run / "command.json").write_text(json.dumps(sign({"argv": ["digits"]})))
    assert main(["train", "--resume", str(run), "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trained with seed 0" in err and "Resume with --seed 0" in err, err


def test_the_cli_under_a_dangling_default_runs_folder_says_what_is_in_the_way(tmp_path, monkeypatch, capsys):
    from mixtrain.cli.main import main
    from mixtrain.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixtrain_runs").symlink_to(tmp_path / "gone")
    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: pytest.fail("training started"))
    assert main(["train", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'mixtrain_runs' is a symbolic link to" in err and "remove the link" in err
