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
    with pytest.raises(ValueError, match="symbolic link"):
        worker_log.open_log(path)
    with pytest.raises(ValueError, match="symbolic link"):
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


def test_a_remote_log_copy_is_private_and_never_written_through_a_planted_symlink(tmp_path, monkeypatch):
    # the driver copies remote workers' logs into RUN_DIR/logs when the run ends; a dangling symlink planted
    # at a worker's log name must not be followed (write_text created the file it pointed to)
    from mixtrain.cluster.placement import WorkerSpec
    from mixtrain.group import worker_group
    from mixtrain.group.membership import Member, Membership
    from mixtrain.group.worker_calls import WorkerCalls
    from mixtrain.group.worker_group import WorkerGroup
    from mixtrain.records.tunables import Tunables

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self):
            return self.value

    class Actor:
        def __init__(self, name):
            self.log_text = Remote((name, f"output of {name}\n"))

    monkeypatch.setattr(worker_group.ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(worker_group.ray, "get", lambda ref: ref)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "worker-1.log").symlink_to(tmp_path / "victim")  # dangling
    group = WorkerGroup.__new__(WorkerGroup)
    group.log_dir, group.tunables = logs, Tunables()
    spec = WorkerSpec(rank=0, device="cpu", bundle={"CPU": 1.0}, label_selector={}, threads=1, precision="fp32")
    names = ("worker-1.log", "worker-2.log", "../escaped.log")
    group.members = Membership([Member(worker=WorkerCalls(Actor(n)), spec=spec) for n in names])
    group._fetch_remote_logs()
    assert not (tmp_path / "victim").exists() and (logs / "worker-1.log").is_symlink()
    assert (logs / "worker-2.log").read_text() == "output of worker-2.log\n" and _mode(logs / "worker-2.log") == 0o600
    assert not (tmp_path / "run" / "escaped.log").exists()


def test_a_follower_sends_lines_as_they_are_appended_and_the_rest_when_it_stops(tmp_path):
    import threading

    from mixtrain.observe.worker_log import LogFollower

    log = tmp_path / "worker-0.log"
    log.write_text("before the loop\n")
    sent: list[tuple[list[str], bool]] = []
    arrived = threading.Event()

    def send(lines: list[str], wait: bool) -> None:
        sent.append((lines, wait))
        arrived.set()

    follower = LogFollower(log, send, poll_s=0.01)
    with open(log, "a") as f:
        f.write("epoch 0 loss 1.2\nhalf a li")
        f.flush()
        assert arrived.wait(30)  # sent while the file is still being written: not at the end
        assert sent == [(["epoch 0 loss 1.2"], False)]
        f.write("ne\n 10%\r 50%\r100%\nno end")
    follower.stop()
    assert [line for lines, _ in sent for line in lines] == ["epoch 0 loss 1.2", "half a line", "100%", "no end"]
    assert sent[-1][1] is True  # the last lines: sent and waited for
