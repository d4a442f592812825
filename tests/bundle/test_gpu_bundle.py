"""The GPU check's bundle, end to end on this machine: `gpu/bundle.py` builds it for this Python, it installs
with `pip --no-index` into a fresh virtual environment that holds only what the GPU machine's image holds
(no Ray, no jsonschema, no mixtrain), and `gpu/check.py` runs there: its CPU steps train for real, every GPU
step says it was skipped for want of a CUDA device.

Building downloads Ray's wheel for this Python once (cached in .gpu-cache/, ignored by git); the archive is
packed at xz level 1 here (seconds) instead of 9 (a minute), the only difference from `make gpu-bundle`."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from packaging.utils import canonicalize_name

from gpu.bundle import IMAGE_PACKAGES, RAY_PRUNE
from tests.venvs import linked_venv

REPO = Path(__file__).resolve().parents[2]
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.slow


def image_like_venv(root: Path) -> Path:
    """A fresh virtual environment that sees, of this environment's packages, only those the GPU machine's
    image holds (torch, numpy, pytest, pip, ...)."""
    return linked_venv(root, lambda name: name in IMAGE_PACKAGES)[0]


def test_the_bundle_installs_offline_and_the_checks_cpu_path_runs(tmp_path):
    t0 = time.perf_counter()
    bundle = tmp_path / "bundle"
    build = subprocess.run(
        [sys.executable, "-m", "gpu.bundle", "--python-version", PYVER, "--out", str(bundle), "--xz-level", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["python_version"] == PYVER and manifest["ray"]["version"] == "2.60.0"
    names = {canonicalize_name(w["file"].split("/")[1].split("-")[0]) for w in manifest["wheels"]}
    assert {"mixtrain", "jsonschema", "referencing", "rpds-py"} <= names
    assert not names & IMAGE_PACKAGES, "a package the GPU image already holds was bundled"
    assert manifest["total_bytes"] < 48 * 2**20
    with tarfile.open(bundle / manifest["ray"]["file"]) as tar:
        members = tar.getnames()
        raylet = tar.getmember("ray/core/src/ray/raylet/raylet")
    assert "ray/__init__.py" in members and raylet.mode & 0o100, "the raylet must stay executable"
    assert not [m for m in members if m.startswith(RAY_PRUNE)]
    build_s = time.perf_counter() - t0

    python = image_like_venv(tmp_path)
    probe = "import torch, pytest, numpy\ntry:\n import ray\nexcept ImportError:\n print('no ray')"
    assert subprocess.run([str(python), "-c", probe], capture_output=True, text=True).stdout.strip() == "no ray"

    out = tmp_path / "report"
    check = subprocess.run(
        [str(python), "gpu/check.py", "--bundle", str(bundle), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    report = json.loads((out / "gpu-check.json").read_text())
    steps = {s["step"]: s for s in report["steps"]}
    text = (out / "gpu-check.txt").read_text()
    assert check.returncode == 0, text + check.stderr[-2000:]
    print(f"\nbundle built in {build_s:.0f} s; offline install + check in {time.perf_counter() - t0 - build_s:.0f} s")
    print(text)

    assert steps["install"]["result"] == "pass"
    env = report["environment"]
    assert env["ray"] == "2.60.0"
    assert "/site/" in env["ray_path"] and "/site/" in env["mixtrain_path"], "Ray and mixtrain come from the bundle"
    assert env["torch"] == torch.__version__
    assert steps["digits-cpu"]["result"] == "pass" and "held-out accuracy" in steps["digits-cpu"]["figure"]
    assert any(line.strip().startswith("predicted:") for line in steps["digits-cpu"]["detail"]), "the plan table"
    assert steps["exact-cpu"]["result"] == "pass"
    gpu_steps = [n for n in steps if "cuda" in n or n in ("precision-auto", "overhead", "nccl")]
    assert len(gpu_steps) == 11 and {"loop-cuda-cpu", "sliced-cuda-cpu", "caps-cuda-cpu"} <= set(gpu_steps), gpu_steps
    if not torch.cuda.is_available():
        assert report["device"].startswith("no CUDA device")
        for name in gpu_steps:
            assert steps[name]["result"] == "skipped" and steps[name]["figure"] == "no CUDA device: skipped", name
        assert steps["pytest-gpu"]["result"] == "skipped" and "no CUDA device: skipped" in steps["pytest-gpu"]["figure"]
    assert len(text) < 16_000 and len((out / "gpu-check.json").read_text()) < 16_000, "a compact report"
    assert "| device | step | result | figure | date |" in text
