"""A run folder is data: hypothesis picks a path a run folder holds (every file, every folder, each checkpoint's
files, both doors' checkpoints) and plants something there (a link to a file outside, a link to a pipe outside, a
dangling link, a pipe, a folder where a file belongs or a file where a folder belongs, a 2 MB file, malformed
bytes), then runs what reads or writes a folder without Ray: `mixtrain report`, a `Task` resume's reads and writes
(command.json, the newest good checkpoint, config.json and metrics.jsonl) and a loop resume's checkpoint. Each ends
in success or one clear refusal within 10 s, writes nothing outside the folder, follows no link (a link to a pipe
would block a reader that followed it) and leaves every file it did not write as it was.

The resumes through Ray (`fit(resume=...)`, `train --resume`) read the folder with these same functions first; the
property here is over those functions, not a Ray start per case."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixtrain._checkpoint_folders import CheckpointError
from mixtrain.checkpoint import CheckpointStore, save_weights
from mixtrain.cli.saved_command import read_command
from mixtrain.errors import InputError
from mixtrain.observe.runlog import RunLog
from mixtrain.train._store import LoopCheckpoints
from mixtrain.trainer import load_resume
from tests.unit.test_report import _a_run
from tests.unit.test_run_files import within

META = {"epoch": 1, "step": 0, "global_step": 4, "shares": [64], "num_workers": 1, "workers": [{"host": "h"}]}
WRITES = {"config.json", "metrics.jsonl"}
"""What a resume writes (config.json replaced, metrics.jsonl appended); report writes under report/."""


def _template(root: Path) -> Path:
    run = root / "template"
    _a_run(run)
    (run / "command.json").write_text('{"argv": ["digits"]}\n')
    (run / "logs").mkdir()
    (run / "logs" / "worker-0.log").write_text("worker 0\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.h").write_bytes(b"\0events")
    save_weights({"w": torch.ones(2)}, run / "model.safetensors")
    CheckpointStore(run).save({"model": {"w": torch.ones(2)}, "optimizer": {}}, META)
    LoopCheckpoints(run, 3).save({"model.pt": b"loop weights", "sub/opt.pt": b"adam"}, {"report": 1})
    (run / "report").mkdir()
    (run / "report" / "summary.txt").write_text("an earlier report\n")
    return run


def _entries(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _template(tmp_path_factory.mktemp("plants"))


PLANTS = ["link to a file outside", "link to a pipe outside", "dangling link", "pipe", "folder or file swapped",
          "2 MB file", "malformed bytes"]  # fmt: skip
COMMANDS = ["report", "resume", "loop resume"]


def _plant(target: Path, plant: str, outside: Path, data: bytes) -> None:
    is_dir = target.is_dir()
    if plant == "2 MB file" or (plant == "malformed bytes" and is_dir):
        shutil.rmtree(target) if is_dir else target.unlink()
        target.write_bytes(data * ((2 << 20) // max(1, len(data)) + 1) if plant == "2 MB file" else data)
        return
    if plant == "malformed bytes":
        target.write_bytes(data)
        return
    shutil.rmtree(target) if is_dir else target.unlink()
    if plant == "link to a file outside":
        target.symlink_to(outside / ("folder" if is_dir else "secret"))
    elif plant == "link to a pipe outside":
        target.symlink_to(outside / "pipe")
    elif plant == "dangling link":
        target.symlink_to(outside / "gone")
    elif plant == "pipe":
        os.mkfifo(target)
    else:  # a folder where a file was, a file where a folder was
        target.write_bytes(b"x") if is_dir else target.mkdir()


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under `root`: its kind and mode, a regular file's bytes' hash, a link's target."""
    out: dict[str, Any] = {}
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        key = str(path.relative_to(root))
        if stat.S_ISLNK(info.st_mode):
            out[key] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            out[key] = ("file", stat.S_IMODE(info.st_mode), hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            out[key] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode))
    return out


def _run(command: str, run: Path, capsys: Any) -> None:
    if command == "report":
        from mixtrain.cli.main import main

        code = main(["report", str(run)])
        err = capsys.readouterr().err
        assert code in (0, 2) and "Traceback" not in err and err.count("\n") <= 1, err
        return
    try:
        if command == "resume":  # what fit(resume=...) / train --resume read and write before Ray starts
            read_command(run)
            load_resume(run, lambda _m: None)
            RunLog(run, {"run_id": "x"}).close()
        else:
            LoopCheckpoints(run, 3).latest()
    except (InputError, CheckpointError) as exc:
        assert "\n" not in str(exc), str(exc)  # one line


def _changed_but_allowed(key: str, command: str) -> bool:
    if command == "report":
        return key == "report" or key.startswith("report/")
    return command == "resume" and key in WRITES


def _case(template: Path, case: Path, path: str, plant: str, command: str, content: bytes, capsys: Any) -> None:
    """One (path, plant, command) on a fresh copy of the template run folder, with the property checked."""
    outside, run = case / "outside", case / "run"
    outside.mkdir(parents=True)
    (outside / "secret").write_text("a stand-in secret\n")
    shutil.copytree(template, outside / "folder", symlinks=True)
    os.mkfifo(outside / "pipe")  # a reader that followed a link to it would block: the 10 s bound catches it
    shutil.copytree(template, run, symlinks=True)
    _plant(run / path, plant, outside, content)
    before_outside, before_run = _snapshot(outside), _snapshot(run)
    within(lambda: _run(command, run, capsys))
    assert _snapshot(outside) == before_outside, (path, plant, command)
    after = _snapshot(run)
    changed = {k for k in before_run.keys() | after.keys() if before_run.get(k) != after.get(k)}
    assert all(_changed_but_allowed(k, command) for k in changed), (path, plant, command, changed)
    for key in WRITES & changed:  # a resume's own writes: regular private files, never a planted link's target
        assert after[key][0] == "file" and after[key][1] == 0o600, (key, after[key])
    shutil.rmtree(case)


@settings(max_examples=int(os.environ.get("PLANT_EXAMPLES", "60")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(data=st.data())
def test_any_plant_at_any_path_ends_in_success_or_one_line_and_touches_nothing_else(template, tmp_path, capsys, data):
    path = data.draw(st.sampled_from(_entries(template)), label="path")
    plant = data.draw(st.sampled_from(PLANTS), label="plant")
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    content = data.draw(st.binary(min_size=0, max_size=64), label="bytes")
    _case(template, tmp_path / f"case-{time.monotonic_ns()}", path, plant, command, content, capsys)


@pytest.mark.skipif(not os.environ.get("PLANT_SWEEP"), reason="every case (minutes): PLANT_SWEEP=1")
def test_every_plant_at_every_path(template, tmp_path, capsys):
    """The same property over every (path, plant, command), malformed content `0`; failures listed together."""
    failures, start = [], time.monotonic()
    cases = [(p, plant, c) for c in COMMANDS for p in _entries(template) for plant in PLANTS]
    for n, (path, plant, command) in enumerate(cases):
        try:
            _case(template, tmp_path / f"case-{n}", path, plant, command, b"0", capsys)
        except AssertionError as exc:
            failures.append((path, plant, command, str(exc)[:200]))
    print(f"{len(cases)} cases in {time.monotonic() - start:.0f} s, {len(failures)} failed")
    assert not failures, failures
