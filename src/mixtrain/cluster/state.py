"""What `cluster up/join` started on this machine, and whether it is still that.

`cluster.json` in $MIXTRAIN_HOME names the process group of the `ray start --block` that up/join
spawned. A process-group id is only a number: after a reboot, or once the group is gone, the same
number can belong to any program. So the record also holds the machine's boot id and the leader's
start time, and nothing is signalled unless both still match (or, for a record written before they
were kept, unless the leader's command line is still `ray start ... --block`).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import psutil

from mixtrain._constants import HOME_ENV
from mixtrain._files import write_json

START_TIME_TOLERANCE_S = 0.05
"""Start times are read from the kernel in clock ticks (10 ms on Linux): equal within this."""


class ClusterError(RuntimeError):
    """A cluster command could not do its work; the message says why and what to do."""


def home() -> Path:
    """$MIXTRAIN_HOME (default ~/.mixtrain): this user's own folder, private (0700), made so if it is not. It holds
    the cluster token, and `cluster down` signals the processes recorded there: a folder someone else owns (or
    could write to) would let them choose both, so one owned by another user is refused."""
    path = Path(os.environ.get(HOME_ENV, Path.home() / ".mixtrain"))
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise ClusterError(
            f"{path} (MIXTRAIN_HOME) is not a folder; remove it or set MIXTRAIN_HOME to a folder of yours"
        )
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ClusterError(
            f"{path} (MIXTRAIN_HOME) belongs to user id {info.st_uid}, not to you (user id {os.getuid()}): its "
            "owner could plant the cluster token and the processes `cluster down` stops. Set MIXTRAIN_HOME to a "
            "folder of your own, or remove that one"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:  # ours but loosened (made by hand, or by an umask): private again
        os.chmod(path, 0o700)
    return path


def boot_id() -> str:
    """Changes with every boot: Linux's random boot id, else the boot time (macOS: kern.boottime)."""
    linux = Path("/proc/sys/kernel/random/boot_id")
    if linux.is_file():
        return linux.read_text().strip()
    return f"boot-time-{psutil.boot_time():.0f}"


def start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), or None when there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


@dataclass(kw_only=True)
class NodeState:
    role: str  # "head" or "worker"
    address: str  # the head's GCS address, HOST:PORT
    node_ip: str
    pgid: int
    log: str
    boot_id: str = ""
    """The machine's boot when `ray start` was spawned ("": a record from before it was kept)."""
    started_at: float = 0.0
    """The start time of the group's leader, `ray start --block` (0: not recorded)."""


def _path() -> Path:
    return home() / "cluster.json"


def load_state() -> NodeState | None:
    """This machine's record, or None. A record that cannot be read is treated as none (and reported)."""
    path = _path()
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(NodeState)}
        return NodeState(**{k: v for k, v in raw.items() if k in known})
    except (ValueError, TypeError) as exc:
        raise ClusterError(f"{path} is unreadable ({exc}); if no mixtrain cluster runs here, delete it") from None


def record(*, role: str, address: str, node_ip: str, pid: int, log: str) -> NodeState:
    """Save what was just started: process `pid` leads its own process group (start_new_session)."""
    state = NodeState(
        role=role,
        address=address,
        node_ip=node_ip,
        pgid=pid,
        log=log,
        boot_id=boot_id(),
        started_at=start_time(pid) or 0.0,
    )
    write_json(asdict(state), _path())  # atomic: a crash or a full disk leaves the previous record
    return state


def forget() -> None:
    _path().unlink(missing_ok=True)


def _looks_like_ray_start(cmdline: list[str]) -> bool:
    return "start" in cmdline and "--block" in cmdline and any("ray" in part for part in cmdline)


def _members(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def not_ours(state: NodeState) -> str | None:
    """None when process group `state.pgid` is still the Ray that up/join started, else why not."""
    if state.boot_id and state.boot_id != boot_id():
        return "the machine has restarted since (another boot id)"
    try:
        leader = psutil.Process(state.pgid)
        leader_start, cmdline = leader.create_time(), leader.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        leader = None
    except psutil.AccessDenied:
        return f"process {state.pgid} belongs to another user now"
    if leader is not None:
        if state.started_at:
            if abs(leader_start - state.started_at) > START_TIME_TOLERANCE_S:
                return f"process {state.pgid} is another program now (it started at {time.ctime(leader_start)})"
            return None
        return None if _looks_like_ray_start(cmdline) else f"process {state.pgid} is not `ray start` now"
    # The leader exited; its children may still hold the group. A group id is not handed out again while the
    # group has members, but check that each started after the recorded leader all the same.
    members = _members(state.pgid)
    if not members:
        return "its processes have exited"
    if state.started_at and all(m.create_time() >= state.started_at - START_TIME_TOLERANCE_S for m in members):
        return None
    return f"process group {state.pgid} cannot be confirmed as the Ray that was started"


def node_gone(state: NodeState) -> bool:
    """True when the recorded group runs no raylet any more: this machine's Ray node is over (the head
    declared it dead after a network partition, or it crashed), whatever of its helpers lingers."""
    for proc in _members(state.pgid):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and "raylet" in proc.name():
                return False
        except psutil.Error:
            continue
    return True


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs; a zombie (exited, waiting for its parent to collect it)
    keeps the group id in use but is done."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for proc in _members(pgid):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def _kill_group(pgid: int, timeout_s: float = 20.0, child: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, then SIGKILL what is left after `timeout_s`. `child`: the leader when it is this
    process's own child, collected while waiting."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child is not None:
                child.poll()
            if not _group_alive(pgid):
                return
            time.sleep(0.2)


def stop(state: NodeState) -> str | None:
    """Stop the recorded Ray processes if they are still ours; returns why nothing was signalled, else None.
    The record is removed either way."""
    why = not_ours(state)
    if why is None:
        _kill_group(state.pgid)
    forget()
    return why


def kill_started(proc: subprocess.Popen) -> None:
    """Stop a group this process spawned a moment ago (its start-up failed)."""
    _kill_group(proc.pid, child=proc)
