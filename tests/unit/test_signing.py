"""A run folder is data: what in it can choose code is signed with this user's key (signing.py), and a resume of a
folder that is unsigned, edited or signed by someone else runs nothing without --trust-job. Real files, real key,
and the real `mixtrain` command for what a planted folder would make it run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mixtrain import signing
from mixtrain.errors import InputValueError

MIXTRAIN = str(Path(sys.executable).parent / "mixtrain")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_key_is_made_once_private_and_signs_what_it_signed(home):
    record = {"argv": ["digits", "--epochs", "2"], "job": "digits", "args": {"width": 3}}
    signed = signing.sign(record)
    key = home / signing.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == signing.KEY_BYTES
    assert [p.name for p in home.iterdir()] == [signing.KEY_FILE]  # no temporary file left behind
    assert signing.signed_by_me(signed) and signing.signed_by_me(json.loads(json.dumps(signed)))
    assert signing.sign(record) == signed  # the same key again, not a new one
    for edited in ({**signed, "job": "os:system"}, {**signed, "args": {"width": 4}}, record, {**signed, "x": 1}):
        assert not signing.signed_by_me(edited)
    key.unlink()  # another user's key (or a new one): their signature is not ours
    assert not signing.signed_by_me(signed)


def test_a_key_file_anyone_else_could_write_or_a_link_is_refused_never_used(home, tmp_path):
    signing.sign({})
    key = home / signing.KEY_FILE
    os.chmod(key, 0o644)
    with pytest.raises(InputValueError, match="readable or writable by others"):
        signing.sign({})
    key.unlink()
    (tmp_path / "planted").write_bytes(b"k" * signing.KEY_BYTES)
    os.chmod(tmp_path / "planted", 0o600)
    key.symlink_to(tmp_path / "planted")
    with pytest.raises(InputValueError, match="a symlink is refused"):
        signing.sign({})
    key.unlink()
    key.symlink_to(tmp_path / "nowhere")  # dangling: the new key is not written through it
    with pytest.raises(InputValueError, match="a symlink is refused"):
        signing.sign({})
    assert not (tmp_path / "nowhere").exists()


def _planted(tmp_path: Path, record: dict) -> Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "command.json").write_text(json.dumps(record))
    return run


def _mixtrain(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MIXTRAIN_HOME": str(tmp_path / "home")}
    return subprocess.run([MIXTRAIN, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)


def test_a_planted_folder_does_not_run_a_command_on_resume(tmp_path):
    """The review's case: the standard library's os.system named as the job, its command as the job's argument."""
    _planted(tmp_path, {"argv": ["os:system"], "job_file": os.__file__, "args": {"command": "id > PWNED"}})
    proc = _mixtrain(tmp_path, "train", "--resume", "run")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "is not signed with your key" in proc.stderr, proc.stderr
    assert f"import and run os:system(command='id > PWNED') from {os.__file__}" in proc.stderr
    assert "--trust-job" in proc.stderr
    assert not (tmp_path / "PWNED").exists()
    proc = _mixtrain(tmp_path, "train", "--resume", "run", "--trust-job")  # trusted: still not a job function
    assert proc.returncode == 2 and "os:system' is a builtin_function_or_method, not a job function" in proc.stderr
    assert not (tmp_path / "PWNED").exists()


def test_a_signed_record_edited_afterwards_is_refused(tmp_path, monkeypatch, capsys):
    from mixtrain.cli.main import main
    from mixtrain.cli.saved_command import save_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    save_command(["train", "digits", "--logger", "csv"], tmp_path / "run", "digits", {}, {})
    record = json.loads((tmp_path / "run" / "command.json").read_text())
    assert signing.signed_by_me(record)
    record["argv"] = ["digits", "--logger", "mlflow"]  # where the metrics go: chosen by whoever edited it
    (tmp_path / "run" / "command.json").write_text(json.dumps(record))
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert "not signed with your key" in err and "train digits with the flags digits --logger mlflow" in err


@pytest.mark.parametrize("value", ["3", True, [1]])
def test_a_jobs_saved_arguments_are_checked_against_its_signature(tmp_path, monkeypatch, value):
    from mixtrain.job import load_job

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sigjob.py").write_text("def make(width=2, *, name='a'):\n    raise SystemExit('ran')\n")
    with pytest.raises(InputValueError, match=r"\[args\] width = .*takes a int there \(its default is 2\)"):
        load_job("sigjob:make", args={"width": value})


def test_a_new_run_where_no_key_can_be_made_starts_unsigned_with_a_note(tmp_path, monkeypatch, capsys):
    from mixtrain.cli.saved_command import read_command, save_command

    (tmp_path / "home").write_text("a file where the folder belongs")
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    save_command(["train", "digits"], tmp_path / "run", "digits", {}, {})
    assert "command.json is not signed" in capsys.readouterr().err
    saved = read_command(tmp_path / "run")
    assert saved is not None and not saved.signed  # its resume asks for --trust-job
