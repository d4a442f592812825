"""Worker logs on a node other than the driver's: a private folder, private files, no symlink followed."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from mixtrain.observe import worker_log


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what gettempdir() answers
    return tmp_path


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_remote_workers_log_is_private_and_under_this_users_folder(tmp):
    path = worker_log.log_path("/runs/a/logs", "driver-node", "this-node", "worker-1.log")
    base = tmp / f"mixtrain-logs-{os.getuid()}"
    assert path == base / "a" / "worker-1.log"
    assert _mode(base) == 0o700 and _mode(base / "a") == 0o700
    os.close(worker_log.open_log(path))
    assert _mode(path) == 0o600
    # a folder of ours that someone loosened is made private again
    os.chmod(base, 0o777)
    worker_log.log_path("/runs/a/logs", "driver-node", "this-node", "worker-2.log")
    assert _mode(base) == 0o700


def test_a_log_path_planted_as_a_symlink_is_refused_and_its_target_untouched(tmp):
    victim = tmp / "victim"
    victim.write_text("keep me")
    path = worker_log.log_path("/runs/a/logs", "driver-node", "this-node", "worker-1.log")
    path.symlink_to(victim)
    with pytest.raises(OSError):
        worker_log.open_log(path)
    with pytest.raises(OSError):
        worker_log.read_tail(path)
    assert victim.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")
def test_a_folder_another_user_made_or_a_symlink_is_not_used(tmp):
    theirs = tmp / f"mixtrain-logs-{os.getuid()}"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)  # made first by another user (the test runs as root)
    path = worker_log.log_path("/runs/a/logs", "driver-node", "this-node", "worker-1.log")
    assert not path.is_relative_to(theirs) and _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    theirs.rmdir()
    (tmp / "elsewhere").mkdir()
    theirs.symlink_to(tmp / "elsewhere")
    path = worker_log.log_path("/runs/b/logs", "driver-node", "this-node", "worker-1.log")
    assert not path.is_relative_to(theirs) and not (tmp / "elsewhere" / "b").exists()
