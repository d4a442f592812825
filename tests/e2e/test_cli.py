"""The README's main job, through the real `mixtrain` command: its own embedded Ray, real data."""

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

MIXTRAIN = str(Path(sys.executable).parent / "mixtrain")


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([MIXTRAIN, *args], capture_output=True, text=True, timeout=timeout)


def test_digits_main_job_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--example", "digits", "--workers", "2", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy >= 0.95, proc.stdout
    assert f"run folder: {run_dir}" in proc.stdout
    # live progress and per-epoch lines go to the terminal (stderr), Ray's own logs do not
    assert "epoch 9: loss" in proc.stderr and "samples/s" in proc.stderr
    assert "INFO" not in proc.stderr and "raylet" not in proc.stderr
    config = json.loads((run_dir / "config.json").read_text())
    assert config["shares"] == [32, 32] and config["scaling"]["num_workers"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 10 and abs(evals[-1]["accuracy"] - accuracy) < 1e-4
    rounds = [r for r in records if r["kind"] == "round"]
    assert sum(r["samples"] for r in rounds) == 10 * config["num_samples"]
    assert all(len(r["workers"]) == 2 for r in rounds)
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert "head.3.weight" in state


def test_bad_flags_name_the_flag_and_the_fix(tmp_path):
    proc = run_cli("train", "--workers", "0")
    assert proc.returncode == 2 and "--workers" in proc.stderr and "must be >= 1" in proc.stderr
    proc = run_cli("train", "--example", "imagenet")
    assert proc.returncode == 2 and "--example 'imagenet': choose one of digits" in proc.stderr
    proc = run_cli("train", "--shares", "40,20", "--run-dir", str(tmp_path))
    assert proc.returncode == 2 and "shares=[40, 20] sum to 60 but global_batch=64" in proc.stderr
    proc = run_cli("train", "--shares", "4x")
    assert proc.returncode == 2 and "--shares" in proc.stderr
