"""The snippets of README.md and docs/*.md tagged `<!-- tested: TAG -->` run exactly as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.doc_pages import block_tagged


def _run_block(tag: str, tmp_path) -> str:
    """The block tagged `tag`, saved as a script and run as a user would: its stdout (it must exit 0)."""
    script = tmp_path / f"{tag.replace('-', '_')}.py"
    script.write_text(block_tagged(tag))
    proc = subprocess.run(
        [sys.executable, script.name], capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_your_own_training_code_script_trains_as_written(tmp_path):
    stdout = _run_block("own-code", tmp_path)
    accuracy = float(re.search(r"held-out accuracy (\d\.\d+)", stdout).group(1))
    assert accuracy > 0.9, stdout  # a linear model cannot pass 0.5 on this XOR-shaped task


def test_the_schedule_with_total_steps_trains_as_written(tmp_path):
    stdout = _run_block("schedule", tmp_path)
    match = re.search(r"(\d+) steps, held-out accuracy (\d\.\d+)", stdout)
    assert match and match.group(1) == "80" and float(match.group(2)) > 0.9, stdout


def test_your_own_loop_script_trains_as_written(tmp_path):
    stdout = _run_block("own-loop", tmp_path)
    accuracy = float(re.search(r"held-out accuracy (\d\.\d+)", stdout).group(1))
    assert accuracy > 0.9, stdout


def test_the_sliced_loop_script_trains_and_saves_as_written(tmp_path):
    stdout = _run_block("sliced-loop", tmp_path)
    match = re.search(r"loss (\d\.\d+), (\d+) tensors saved", stdout)
    assert match and float(match.group(1)) < 0.5 and match.group(2) == "4", stdout
    saved = torch.load(tmp_path / "sliced.pt")
    assert saved["epoch"] == 3 and len(saved["optimizer"]["state"]) == 4, saved["optimizer"]["state"].keys()
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == {
        "0.weight": (32, 2),
        "0.bias": (32,),
        "2.weight": (2, 32),
        "2.bias": (2,),
    }


def test_a_sweep_with_kept_workers_runs_as_written(tmp_path, monkeypatch, capsys, ray_session):
    """The keep-workers snippet, in this process (its Ray is the session's): the second fit trains on the first
    fit's worker processes (their log files carry their pids)."""
    import mixtrain

    mixtrain.release_workers()  # the snippet's first fit starts its own workers, as in a new Python process
    monkeypatch.chdir(tmp_path)  # its run folders: mixtrain_runs/ under the current folder
    exec(compile(block_tagged("keep-workers"), "keep_workers.py", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    accuracies = [float(s) for s in re.findall(r"lr [\d.e-]+: accuracy (\d\.\d+), first step after \d+\.\d s", out)]
    assert len(accuracies) == 2 and min(accuracies) > 0.8, out
    logs = [sorted(p.name for p in (tmp_path / "mixtrain_runs" / name / "logs").iterdir()) for name in
            ("sweep-lr0.001", "sweep-lr0.003")]  # fmt: skip
    assert logs[0] == logs[1] and len(logs[0]) == 2, logs  # worker-RANK-cpu-pidPID.log: the same processes
    assert mixtrain.worker.warm_workers.kept() == 0  # release_workers() freed them


def test_the_habits_script_evaluates_every_25_steps_and_keeps_the_best(tmp_path):
    stdout = _run_block("habits", tmp_path)
    steps = [int(s) for s in re.findall(r"^step (\d+): held-out accuracy", stdout, re.M)]
    assert steps and steps == list(range(25, 25 * len(steps) + 1, 25)) and steps[-1] <= 200, stdout
    stopped = re.search(r"stopped early: (.*)", stdout).group(1)
    assert steps[-1] == 200 or "EarlyStopping" in stopped, stdout  # ran to max_steps, or stopped saying why
    best = re.search(r"best checkpoint: (\S+)", stdout).group(1)
    assert Path(best).is_dir() and Path(best).parent.name == "checkpoints", stdout


def test_the_loggers_script_writes_all_three_stores(tmp_path, monkeypatch, capsys, ray_session):
    """The loggers snippet, in this process (its Ray is the session's: no second start-up); each store it
    writes is read back with the tracker's own library."""
    from tests.trackers import mlflow_run, mlflow_steps, tensorboard_scalars, wandb_run

    monkeypatch.chdir(tmp_path)  # its run folder: mixtrain_runs/ under the current folder
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    exec(compile(block_tagged("loggers"), "loggers.py", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    run_dir = Path(re.search(r"run folder: (\S+)", out).group(1))
    for name in ("mlflow.db", "mlartifacts", "wandb", "tensorboard"):
        assert f"'{name}'" in out, out
    client, run = mlflow_run(f"sqlite:///{run_dir / 'mlflow.db'}", "digits")
    assert [s for s, _ in mlflow_steps(client, run, "held_out/accuracy")] == [23, 46]
    assert wandb_run(run_dir)["exit_code"] == 0
    assert "train/lr/group0" in tensorboard_scalars(run_dir / "tensorboard")


def test_the_lora_recipe_checkpoints_adapters_and_writes_the_adapter_folder_as_written(tmp_path):
    pytest.importorskip("peft")
    stdout = _run_block("lora", tmp_path)
    held = int(re.search(r"checkpoint bytes (\d+)", stdout).group(1))
    adapters = 2 * (16 * 128 + 16 * 384) * 4  # lora_A and lora_B of c_attn in 2 layers, fp32
    assert held <= 1.1 * 3 * adapters + 16_000, stdout  # + AdamW's two moments, two workers' random streams
    assert "adapter_config.json" in stdout and "adapter_model.safetensors" in stdout, stdout
