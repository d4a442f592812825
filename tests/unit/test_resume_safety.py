"""`train --resume RUN_DIR` imports and runs the job function the run folder names: a folder from someone
else must not run code by surprise. Real files; a module that leaves a marker when it is imported."""

from __future__ import annotations

import json

import pytest

from mixtrain.cli.main import _check_resumed_job, _save_flags, build_parser, main
from mixtrain.job import module_file

EVIL = "import pathlib\npathlib.Path('IMPORTED').write_text('ran')\ndef make(**kw):\n    raise SystemExit('ran')\n"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.py").write_text(EVIL)
    (tmp_path / "run").mkdir()
    return tmp_path


def _command(folder, **record) -> None:
    (folder / "run" / "command.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    "record",
    [
        {"argv": ["evil:make"]},  # written by hand, or by a mixtrain from before job files were recorded
        {"argv": ["evil:make"], "job_file": "/elsewhere/evil.py"},  # the module comes from another file now
        {"argv": ["evil:make", "--trust-job"], "job_file": "/elsewhere/evil.py"},  # only a flag given now counts
    ],
)
def test_resume_refuses_a_job_module_from_another_file_without_running_it(folder, record, capsys):
    _command(folder, **record)
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert f"would import and run evil:make from {folder / 'evil.py'}" in err and "--trust-job" in err
    assert not (folder / "IMPORTED").exists()


def test_the_recorded_file_or_trust_job_lets_it_through(folder):
    _save_flags(["train", "evil:make", "--epochs", "2", "--trust-job"], folder / "run", "evil:make")
    saved = json.loads((folder / "run" / "command.json").read_text())
    assert saved == {"argv": ["evil:make", "--epochs", "2"], "job": "evil:make", "job_file": str(folder / "evil.py")}
    _check_resumed_job(build_parser().parse_args(["train", "evil:make", "--resume", "run"]))
    _command(folder, argv=["evil:make"], job_file="/elsewhere/evil.py")
    _check_resumed_job(build_parser().parse_args(["train", "evil:make", "--resume", "run", "--trust-job"]))
    _check_resumed_job(build_parser().parse_args(["train", "digits", "--resume", "run"]))  # built-in: no file
    assert not (folder / "IMPORTED").exists()


def test_finding_a_jobs_file_runs_none_of_its_code(folder):
    pkg = folder / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(EVIL)  # even a package's __init__ stays unrun
    (pkg / "jobs.py").write_text(EVIL)
    assert module_file("pkg.jobs:make") == str(pkg / "jobs.py")
    assert module_file("pkg.nothere:make") is None and module_file("digits") is None
    assert not (folder / "IMPORTED").exists()
