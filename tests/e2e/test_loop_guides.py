"""The porting guides of docs/your-own-loop.md run as written: Ray's Fashion-MNIST example moved to mixtrain by its
imports (on the digits), and a torchrun script through `mixtrain run` (issue 35)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

MIXTRAIN = str(Path(sys.executable).parent / "mixtrain")


def test_rays_fashion_mnist_example_with_its_imports_changed_trains_to_the_task_paths_accuracy(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "docs/examples/ray_train_digits.py"), "--epochs", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(re.search(r"'accuracy': (\d\.\d+)", proc.stdout).group(1))
    assert accuracy >= 0.95, proc.stdout  # the digits Task example: 0.98
    assert proc.stderr.count("report ") == 8, proc.stderr


def test_a_torchrun_script_runs_through_mixtrain_run_with_its_own_arguments(tmp_path, ray_address):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [MIXTRAIN, "run", str(REPO / "docs/examples/torchrun_digits.py"), "--workers", "2", "--address", ray_address,
         "--run-dir", str(tmp_path / "run"), "--", "--epochs", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["accuracy"] >= 0.93, result
    assert f"run folder: {tmp_path / 'run'}" in proc.stdout


def test_a_loop_function_runs_from_the_command_line_with_its_config(tmp_path, ray_address):
    (tmp_path / "myloops.py").write_text(
        "import mixtrain.train\n"
        "def train_func(config):\n"
        "    ctx = mixtrain.train.get_context()\n"
        "    mixtrain.train.report({'rank_seen': ctx.get_world_rank(), 'size': ctx.get_world_size(), **config})\n"
    )
    proc = subprocess.run(
        [MIXTRAIN, "run", "myloops:train_func", "--workers", "3", "--cpus-per-worker", "0.5", "--address",
         ray_address, "--loop-config", '{"lr": 0.5}'],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "last report: rank_seen 0, size 3, lr 0.5000" in proc.stdout, proc.stdout
    bad = subprocess.run([MIXTRAIN, "run", "myloops:train_func", "--loop-config", "[1]"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, check=False)  # fmt: skip
    assert bad.returncode == 2 and "--loop-config: a JSON object, not list" in bad.stderr
