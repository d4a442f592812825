"""The GPU check's own machinery, quickly: how Ray's wheel is pruned and packed, which wheels fit the GPU
machine, and how the driver records steps (a failure, a step past its time limit, a GPU step without a GPU,
a step it cannot start in time) without stopping. The whole bundle, installed offline and run, is
tests/bundle/test_gpu_bundle.py."""

from __future__ import annotations

import json
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from gpu import check
from gpu.bundle import compatible, pack_ray


def test_ray_is_packed_without_the_pruned_parts_and_keeps_its_executables(tmp_path):
    wheel = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    files = {
        "ray/__init__.py": (b"x = 1\n", 0o644),
        "ray/core/src/ray/raylet/raylet": (b"\x7fELF", 0o755),
        "ray/jars/ray_dist.jar": (b"jar" * 100, 0o644),
        "ray/rllib/__init__.py": (b"", 0o644),
        "ray/dashboard/client/build/index.html": (b"<html>", 0o644),
        "ray/dashboard/head.py": (b"", 0o644),
    }
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, data)
        record = "".join(f"{n},sha256=x,{len(d)}\n" for n, (d, _) in files.items())
        zf.writestr("ray-2.60.0.dist-info/RECORD", record + "ray-2.60.0.dist-info/RECORD,,\n")
    dest = tmp_path / "ray.tar.xz"
    stats = pack_ray(wheel, dest, xz_level=0)
    assert stats["removed_files"] == 3 and stats["files"] == 3
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == [
            "ray-2.60.0.dist-info/RECORD",
            "ray/__init__.py",
            "ray/core/src/ray/raylet/raylet",
            "ray/dashboard/head.py",
        ]
        assert tar.getmember("ray/core/src/ray/raylet/raylet").mode == 0o755
        kept = tar.extractfile("ray-2.60.0.dist-info/RECORD").read().decode()  # type: ignore[union-attr]
    assert "jars" not in kept and "rllib" not in kept and "client" not in kept and "ray/dashboard/head.py" in kept


def test_only_wheels_for_the_target_python_on_linux_x86_64_are_taken():
    assert compatible("rpds_py-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "3.12")
    assert not compatible("rpds_py-1.0-cp312-cp312-manylinux_2_17_x86_64.whl", "3.11")
    assert not compatible("rpds_py-1.0-cp312-cp312-manylinux_2_17_aarch64.whl", "3.12")
    assert not compatible("rpds_py-1.0-cp312-cp312-win_amd64.whl", "3.12")
    assert compatible("jsonschema-4.26.0-py3-none-any.whl", "3.12")
    assert compatible("pkg-1.0-cp39-abi3-manylinux2014_x86_64.whl", "3.12")


def _sh(code: str, name: str):
    def run(c: check.Check) -> check.Outcome:
        proc = c.sh([sys.executable, "-c", code], name)
        if proc.rc is None:
            return check.Outcome("timeout", f"after {proc.seconds:.1f} s")
        return check.Outcome("pass" if proc.rc == 0 else "fail", f"exit status {proc.rc}", tail=proc.stderr)

    return run


def _broken(c: check.Check) -> check.Outcome:
    raise RuntimeError("the check itself broke")


def test_every_step_is_recorded_whatever_happened_before_it(tmp_path):
    marker = tmp_path / "child.pid"
    # a step that leaves a process behind in its group and outlives its limit: both are killed
    hang = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    steps = [
        check.Step("fails", "exits 3", _sh("import sys; sys.exit(3)", "fails")),
        check.Step("hangs", "sleeps past its limit", _sh(hang, "hangs"), timeout_s=2),
        check.Step("broken", "raises in the driver", _broken),
        check.Step("on-gpu", "needs CUDA", _sh("pass", "on-gpu"), needs_cuda=True),
        check.Step("works", "exits 0", _sh("print('ok')", "works")),
    ]
    c = check.Check(tmp_path / "b", tmp_path / "out", tmp_path / "work", tmp_path / "site", 60, sys.executable)
    c.env = {"cuda_available": False, "cpus": 2}
    t0 = time.monotonic()
    assert c.run(steps) == 1
    assert time.monotonic() - t0 < 20
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    got = {s["step"]: (s["result"], s["figure"]) for s in report["steps"]}
    assert got["fails"] == ("fail", "exit status 3")
    assert got["hangs"][0] == "timeout"
    assert got["broken"] == ("fail", "check error: RuntimeError: the check itself broke")
    assert got["on-gpu"] == ("skipped", "no CUDA device: skipped")
    assert got["works"] == ("pass", "exit status 0")
    assert report["summary"] == {"fail": 2, "timeout": 1, "skipped": 1, "pass": 1}
    pid = int(marker.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    text = (tmp_path / "out" / "gpu-check.txt").read_text()
    assert "| no CUDA device (2 CPU cores) | on-gpu | skipped | no CUDA device: skipped |" in text


def test_a_step_that_cannot_finish_in_the_time_left_is_not_started(tmp_path):
    c = check.Check(tmp_path / "b", tmp_path / "out", tmp_path / "work", tmp_path / "site", 5, sys.executable)
    c.run([check.Step("late", "would need more time", _sh("pass", "late"))])
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert report["steps"][0]["result"] == "not run" and "out of time" in report["steps"][0]["figure"]


def test_without_a_bundle_the_install_step_says_how_to_make_one(tmp_path):
    c = check.Check(tmp_path / "none", tmp_path / "out", tmp_path / "work", tmp_path / "site", 60, sys.executable)
    out = check.install(c)
    assert out.result == "fail" and "make gpu-bundle" in out.figure
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "manifest.json").write_text(json.dumps({"python_version": "2.7"}))
    out = check.install(c)
    assert out.result == "fail" and "make gpu-bundle PYVER=" in out.figure


def test_the_report_goes_to_OUT_when_it_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    # with no time left nothing starts, and the report still says so
    assert check.main(["--only", "env", "--bundle", str(tmp_path / "none"), "--budget-s", "1"]) == 0
    report = json.loads((tmp_path / "o" / "gpu-check.json").read_text())
    assert [(s["step"], s["result"]) for s in report["steps"]] == [("install", "not run"), ("env", "not run")]
    assert (tmp_path / "o" / "gpu-check.txt").exists()


def test_the_lost_worker_step_is_in_the_check_and_is_skipped_cleanly_without_cuda(tmp_path):
    # issue 18, item 10: the first GPU session loses a worker under gloo and NCCL; here there is no GPU
    import subprocess

    from tests.conftest import REPO

    [step] = [s for s in check.STEPS if s.name == "lost-worker"]
    assert step.needs_cuda and step.timeout_s <= 240
    out = tmp_path / "lost.json"
    cmd = [sys.executable, "-m", "gpu.steps", "lost-worker", "--devices", "cuda", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text()) == {"result": "skipped", "figure": "no CUDA device: skipped", "detail": []}
