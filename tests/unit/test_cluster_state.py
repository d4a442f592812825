"""`cluster down` (and up/join) with a cluster.json that no longer describes what runs: real processes, the
recorded process-group id held by an unrelated program, which must never be signalled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mixtrain.cli.main import main
from mixtrain.cluster import headnode, state


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def unrelated():
    """An unrelated program that leads its own process group, as a recorded `ray start --block` did."""
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _write(home, **fields) -> None:
    record = {"role": "head", "address": "10.0.0.1:6379", "node_ip": "10.0.0.1", "log": "x.log", **fields}
    (home / "cluster.json").write_text(json.dumps(record))


def _down(capsys) -> str:
    assert main(["cluster", "down"]) == 0
    return capsys.readouterr().out


def test_after_a_reboot_down_signals_nothing_and_up_is_not_refused(home, unrelated, capsys):
    # the machine rebooted and the recorded group id now belongs to someone else's program
    _write(home, pgid=unrelated.pid, boot_id="a-boot-before", started_at=state.start_time(unrelated.pid))
    headnode._refuse_if_running()  # up/join go ahead, dropping the stale record
    assert "dropped a stale record" in capsys.readouterr().err and not (home / "cluster.json").exists()
    _write(home, pgid=unrelated.pid, boot_id="a-boot-before", started_at=state.start_time(unrelated.pid))
    out = _down(capsys)
    assert "nothing to stop" in out and "restarted" in out
    assert unrelated.poll() is None and not (home / "cluster.json").exists()


def test_a_reused_process_group_id_on_the_same_boot_is_not_signalled(home, unrelated, capsys):
    # same boot, same number, but the process holding it started long after the recorded one
    started = state.start_time(unrelated.pid)
    assert started is not None
    _write(home, pgid=unrelated.pid, boot_id=state.boot_id(), started_at=started - 3600)
    out = _down(capsys)
    assert f"process {unrelated.pid} is another program now" in out
    assert unrelated.poll() is None  # (a signalled group is waited for until it is gone before down returns)


def test_a_record_from_before_boot_ids_is_checked_by_command_line(home, unrelated, capsys):
    _write(home, pgid=unrelated.pid)  # no boot id, no start time: an older mixtrain wrote it
    assert f"process {unrelated.pid} is not `ray start`" in _down(capsys)
    assert unrelated.poll() is None


def _ray_start_stand_in(child: str) -> subprocess.Popen:
    """A stand-in for `ray start --block` (its own process group) that starts `child` for 120 s."""
    code = f"import subprocess, time; subprocess.Popen([{child!r}, '120']); print('up', flush=True); time.sleep(120)"
    leader = subprocess.Popen(
        [sys.executable, "-c", code, "ray", "start", "--block"], start_new_session=True, stdout=subprocess.PIPE
    )
    assert leader.stdout is not None and leader.stdout.readline() == b"up\n"
    return leader


@pytest.fixture
def raylet(tmp_path) -> str:
    """A program whose process is named raylet (a copy of sleep)."""
    path = tmp_path / "raylet"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", path)
    return str(path)


def test_the_group_that_was_recorded_is_stopped_with_its_children(home, raylet, capsys):
    # a stand-in for `ray start --block` and the raylet it starts, recorded as up/join record it
    leader = _ray_start_stand_in(raylet)
    try:
        child = next(p for p in state._members(leader.pid) if p.pid != leader.pid)
        state.record(role="worker", address="10.0.0.1:6379", node_ip="10.0.0.2", pid=leader.pid, log="x.log")
        with pytest.raises(headnode.ClusterError, match="already runs a mixtrain Ray worker"):
            headnode._refuse_if_running()
        assert "stopped the Ray worker for 10.0.0.1:6379" in _down(capsys)
        assert leader.wait(timeout=10) is not None
        child.wait(timeout=10)  # the whole group, not only its leader
    finally:
        leader.kill()
        leader.wait()


def test_a_node_whose_raylet_is_gone_is_cleared_by_the_next_join(home, capsys):
    # after a partition the head declared this node dead and its raylet exited; a helper lingers in the group:
    # `join` (and `up`) stop what is left with a note instead of asking for `cluster down` first
    leader = _ray_start_stand_in("sleep")
    try:
        helper = next(p for p in state._members(leader.pid) if p.pid != leader.pid)
        state.record(role="worker", address="10.0.0.1:6379", node_ip="10.0.0.2", pid=leader.pid, log="x.log")
        headnode._refuse_if_running()
        assert "has no raylet any more" in capsys.readouterr().err
        assert leader.wait(timeout=10) is not None
        helper.wait(timeout=10)
        assert state.load_state() is None
    finally:
        leader.kill()
        leader.wait()


def test_a_group_whose_leader_exited_is_still_stopped(home, capsys):
    # `ray start --block` died, the processes it started live on in its group: they are still ours
    code = "import subprocess; subprocess.Popen(['sleep', '120']); print('up', flush=True)"
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    assert leader.stdout is not None and leader.stdout.readline() == b"up\n"
    started = state.start_time(leader.pid)
    leader.wait()
    [orphan] = state._members(leader.pid)
    try:
        _write(home, pgid=leader.pid, boot_id=state.boot_id(), started_at=started)
        assert "stopped the Ray head" in _down(capsys)
        orphan.wait(timeout=10)
    finally:
        if orphan.is_running():
            orphan.kill()


def test_a_mixtrain_home_of_ours_that_others_can_enter_is_made_private_again(tmp_path, monkeypatch):
    import stat

    folder = tmp_path / "dot-mixtrain"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o777)  # made by hand, or loosened later: anyone could plant cluster.json there
    monkeypatch.setenv("MIXTRAIN_HOME", str(folder))
    assert state.home() == folder and stat.S_IMODE(os.stat(folder).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")
def test_a_mixtrain_home_another_user_owns_is_refused_and_nothing_signalled(tmp_path, monkeypatch, unrelated, capsys):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("MIXTRAIN_HOME", str(folder))
    _write(folder, pgid=unrelated.pid, boot_id=state.boot_id(), started_at=state.start_time(unrelated.pid))
    os.chown(folder, 12345, 12345)  # its owner wrote a record naming a process of ours
    with pytest.raises(state.ClusterError, match=r"theirs \(MIXTRAIN_HOME\) belongs to user id 12345, not to you"):
        state.home()
    assert main(["cluster", "down"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Set MIXTRAIN_HOME to a folder of your own" in err, err
    assert unrelated.poll() is None  # not signalled
