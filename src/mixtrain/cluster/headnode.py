"""Start, join, inspect and stop a mixtrain Ray cluster: `mixtrain cluster up|join|status|down`.

Each node runs `ray start --block` as a detached process group recorded in $MIXTRAIN_HOME/cluster.json
(default ~/.mixtrain; state.py), so `down` stops exactly the processes `up`/`join` started, and only
while they are still those: never `ray stop`, which kills every Ray on the machine. Token
authentication is always on and proven after `up` (auth.py); what the node opens is kept small
(exposure.py).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixtrain import compat
from mixtrain._constants import CONNECT_TIMEOUT_S, RAY_READY_TIMEOUT_S, env_float
from mixtrain.cluster import exposure, ray_shim
from mixtrain.cluster.auth import (
    apply_auth_env,
    auth_env,
    prove_token_required,
    require_token_auth,
    token_path,
    use_cluster_token,
    write_token,
)
from mixtrain.cluster.connect import check_reachable, device_resources, system_env
from mixtrain.cluster.state import (
    ClusterError,
    NodeState,
    forget,
    home,
    kill_started,
    load_state,
    node_gone,
    not_ours,
    record,
    stop,
)
from mixtrain.comm.netif import hostname_trap, ipv4_addresses
from mixtrain.compat import version_mismatches

__all__ = [
    "ClusterError",
    "NodeState",
    "auth_env",
    "down",
    "join",
    "load_state",
    "status",
    "token_path",
    "up",
    "use_cluster_token",
]

CARD_KEY, CARD_NS = b"head", b"mixtrain"
HEAD_TOKEN = "auth_token.head"
"""In $MIXTRAIN_HOME: the token the running head's Ray processes read (the same as auth_token once `up` succeeded)."""
MAC_HEAD_ADVICE = (
    "note: this Mac is the head. If it sleeps (lid closed, idle), the whole cluster stops, and Ray runs "
    "macOS nodes in a multi-node cluster only at your own risk: where you can, make the Linux or Windows "
    "desktop the head and join from the Mac."
)


def interface_ip(name: str) -> str:
    addrs = ipv4_addresses()
    if name not in addrs:
        raise ClusterError(f"--interface {name!r}: no such interface; this machine has {', '.join(sorted(addrs))}")
    if not addrs[name]:
        raise ClusterError(f"--interface {name!r} has no IPv4 address")
    return addrs[name][0]


def route_ip(peer: str) -> str:
    """The local address this machine uses to reach `peer` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
        except OSError as exc:
            raise ClusterError(f"no route to {peer}: {exc}; pass --interface or --node-ip") from exc
        return s.getsockname()[0]


def pick_node_ip(interface: str | None, node_ip: str | None, peer: str | None) -> str:
    """The address other nodes reach this one at; refuses loopback (the 127.0.1.1 trap, and a Mac's Ray,
    which advertises 127.0.0.1 unless it is given the node's address)."""
    if node_ip:
        ip = node_ip
    elif interface:
        ip = interface_ip(interface)
    else:
        try:
            ip = route_ip(peer or "192.0.2.1")  # TEST-NET: only asks the routing table
        except ClusterError:
            import ray

            ip = ray.util.get_node_ip_address()
    if ip.startswith("127."):
        trap = hostname_trap() or "the only route is loopback"
        raise ClusterError(
            f"this node's address would be {ip} ({trap}); other machines cannot reach it. "
            "Pass --interface (e.g. en0, eth0, wlan0) or --node-ip with the LAN address."
        )
    return ip


def platform_env() -> dict[str, str]:
    """What Ray needs on this OS to be one node of several: on macOS (and Windows) Ray refuses to join a
    multi-node cluster, and reports 127.0.0.1 as the node's address, unless this is set."""
    if platform.system() in ("Darwin", "Windows"):
        return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    return {}


def _ray_cmd() -> list[str]:
    sibling = Path(sys.executable).with_name("ray")
    return [str(sibling)] if sibling.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            _ray_cmd() + args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env},
            start_new_session=True,  # its own process group: `down` stops exactly these processes
        )


def _wait_started(proc: subprocess.Popen, log: Path, ready: Callable[[], bool]) -> None:
    """Wait until `ready()`; on any failure stop what was started, so nothing is left running."""
    ready_s = env_float(RAY_READY_TIMEOUT_S)
    deadline = time.monotonic() + ready_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"`ray start` exited with {proc.returncode}; its log ({log}) ends:\n{_tail(log)}")
            if ready():
                return
            time.sleep(0.5)
        raise ClusterError(
            f"Ray did not start within {ready_s:g} s (MIXTRAIN_RAY_READY_TIMEOUT_S); "
            f"its log ({log}) ends:\n{_tail(log)}"
        )
    except BaseException:
        kill_started(proc)
        raise


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _common_args(node_ip: str, num_cpus: int | None, temp_dir: str | None) -> list[str]:
    # --node-ip-address always: without it a Mac's Ray advertises 127.0.0.1 (ray#24945, #30770)
    args = ["--block", f"--node-ip-address={node_ip}", "--disable-usage-stats"]
    resources = device_resources()
    if resources:
        args.append(f"--resources={json.dumps(resources)}")
    if num_cpus is not None:
        args.append(f"--num-cpus={num_cpus}")
    if temp_dir:
        args.append(f"--temp-dir={temp_dir}")
    return args


def _gcs(address: str) -> Any:
    """Ray's GCS client (internal API, used by Ray's own CLI): KV access without starting a driver. Connecting
    waits at most MIXTRAIN_CONNECT_TIMEOUT_S (Ray's GcsClient waits 30 s); give each call `timeout=kv_timeout()`,
    since without one a GCS that accepted the connection and then hangs is waited on for ever."""
    return ray_shim.gcs_client(address, kv_timeout())


def kv_timeout() -> float:
    """Seconds one call to the GCS may take."""
    return env_float(CONNECT_TIMEOUT_S)


def _put_card(address: str) -> None:
    """Record this machine's versions on the head (`join` compares its own with them)."""
    card = json.dumps({**compat.versions(), "os": platform.system()}).encode()
    _gcs(address).internal_kv_put(CARD_KEY, card, True, CARD_NS, timeout=kv_timeout())


def _refuse_if_running() -> None:
    """Refuse to start a second node here; a record whose processes are gone (or were never these) is
    dropped with a note instead of blocking for no reason."""
    state = load_state()
    if state is None:
        return
    why = not_ours(state)
    if why is None and node_gone(state):  # a partition outlasted the head's health checks: start over
        print(
            f"note: this machine's Ray {state.role} for {state.address} has no raylet any more (its head "
            "declared it dead, e.g. after a network partition, or it crashed); stopping what is left of it",
            file=sys.stderr,
        )
        stop(state)
        return
    if why is None:
        raise ClusterError(
            f"this machine already runs a mixtrain Ray {state.role} for {state.address} (process group "
            f"{state.pgid}); run `mixtrain cluster down` first"
        )
    print(f"note: dropped a stale record of a Ray {state.role} for {state.address}: {why}", file=sys.stderr)
    forget()


_DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


def node_env(interface: str | None, *, head: bool) -> dict[str, str]:
    """Environment of this node's Ray processes (and so of the workers on it)."""
    env = {**exposure.ray_start_env(head=head), **platform_env(), **system_env()}
    # On SIGTERM Ray 2.60's `ray start --block` drains the node for up to 30 s first (for Ray Serve's proxies,
    # which mixtrain does not run), so `cluster down` waited out its 20 s and killed: 22 s a node, 4 s without
    env[_DRAIN_ENV] = os.environ.get(_DRAIN_ENV, "0")  # a value the user set is kept
    if interface:
        env.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)
    return env


def up(
    *,
    port: int,
    interface: str | None,
    node_ip: str | None,
    num_cpus: int | None,
    temp_dir: str | None,
    dashboard: bool = False,
) -> NodeState:
    """Start this machine's Ray head with a new token. The token this machine keeps (token_path(): the one
    `join` and drivers use, maybe another head's) is replaced only once the head runs, demands the token and is
    recorded; until then the head reads it from a file of its own. Any failure stops the head: nothing runs
    that `down` does not know of, and a failed `up` leaves the kept token as it was."""
    import ray.exceptions

    require_token_auth()
    _refuse_if_running()
    ip = pick_node_ip(interface, node_ip, None)
    token = secrets.token_hex(24)
    head_token = home() / HEAD_TOKEN  # Ray's processes read it when they start, the head's workers later too
    token_env = auth_env(token, head_token)  # a new file, 0600
    log = home() / "ray-head.log"
    args = ["start", "--head", f"--port={port}", *exposure.ray_start_args(head=True, dashboard=dashboard)]
    address = f"{ip}:{port}"

    def ready() -> bool:
        try:
            check_reachable(address, timeout_s=0.5)
            _put_card(address)
            return True
        except (ConnectionError, RuntimeError, OSError, ray.exceptions.RayError):
            return False

    proc = None
    try:
        proc = _spawn(
            [*args, *_common_args(ip, num_cpus, temp_dir)], {**token_env, **node_env(interface, head=True)}, log
        )
        apply_auth_env(token_env)
        _wait_started(proc, log, ready)
        prove_token_required(address, token)
        state = record(role="head", address=address, node_ip=ip, pid=proc.pid, log=str(log))
        write_token(token)
        return state
    except BaseException:
        if proc is not None:
            kill_started(proc)
            forget()  # recorded already, or a stale record _refuse_if_running let go of
        head_token.unlink(missing_ok=True)
        raise


def head_card(address: str) -> dict[str, str]:
    """The versions `cluster up` recorded on the head."""
    raw = _gcs(address).internal_kv_get(CARD_KEY, CARD_NS, timeout=kv_timeout())
    if raw is None:
        raise ClusterError(
            f"{address} is a Ray head but was not started by `mixtrain cluster up` (no version card); "
            "start it with `mixtrain cluster up`, or join with plain `ray start --address`"
        )
    return json.loads(raw)


def parity_problems(head: dict[str, str], mine: dict[str, str]) -> list[str]:
    """Why this machine cannot join the head: the same rules as the preflight before training."""
    return [f"{f}: the head has {a}, this machine has {b}" for f, a, b, _ in version_mismatches(head, mine)]


def join(
    address: str,
    *,
    token: str | None,
    interface: str | None,
    node_ip: str | None,
    num_cpus: int | None,
    temp_dir: str | None,
) -> NodeState:
    require_token_auth()
    _refuse_if_running()
    check_reachable(address)
    env = auth_env(token)
    apply_auth_env(env)
    try:
        card = head_card(address)
    except ClusterError:
        raise
    except Exception as exc:  # Ray raises several types for a bad token or a dead head
        raise ClusterError(
            f"could not read the head's version card at {address}: {exc}. Check the token: copy the file that "
            "`mixtrain cluster up` named (its auth_token) again and pass it with --token-file."
        ) from exc
    problems = parity_problems(card, compat.versions())
    if problems:
        raise ClusterError(
            "refusing to join: " + "; ".join(problems) + ". Install the same versions here (for Python: a "
            f"virtual environment with Python {card.get('python')}, e.g. `uv venv -p {card.get('python')}`)."
        )
    if platform_env():
        print(
            "note: Ray supports macOS nodes in a multi-node cluster only at your own risk "
            "(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 is set for this node).",
            file=sys.stderr,
        )
    ip = pick_node_ip(interface, node_ip, address.rpartition(":")[0])
    env.update(node_env(interface, head=False))
    log = home() / "ray-worker.log"
    offset = log.stat().st_size if log.exists() else 0
    args = [
        "start",
        f"--address={address}",
        *_common_args(ip, num_cpus, temp_dir),
        *exposure.ray_start_args(head=False),
    ]
    proc = _spawn(args, env, log)

    def ready() -> bool:
        return "Ray runtime started" in log.read_text(errors="replace")[offset:]

    _wait_started(proc, log, ready)
    return record(role="worker", address=address, node_ip=ip, pid=proc.pid, log=str(log))


def down() -> tuple[NodeState, str | None] | None:
    """Stop the Ray processes this machine's `up`/`join` started. None when there is no record; else the
    record and, when nothing was signalled, why (the processes were gone, or are another program's now)."""
    state = load_state()
    if state is None:
        return None
    why = stop(state)
    if state.role == "head":
        (home() / HEAD_TOKEN).unlink(missing_ok=True)
    return state, why


def node_report() -> dict:
    """What `cluster status` shows for one node; runs on that node."""
    import ray

    from mixtrain import devices

    return {
        "ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "cpus": os.cpu_count(),
        "devices": [d.as_dict() for d in devices.local_devices()],
        "versions": compat.versions(),
        "os": platform.system(),
    }


def status(address: str, timeout_s: float = 60.0) -> list[dict]:
    """One report per alive node, gathered by a zero-CPU task pinned to each node."""
    import logging

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_reachable(address)
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        task = ray.remote(num_cpus=0)(node_report)
        refs = [
            task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes
        ]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for node, ref in zip(nodes, refs):
            if ref in ready:
                report: dict = ray.get(ref)
                out.append({**report, "head": "node:__internal_head__" in node["Resources"]})
            else:
                out.append({"ip": node["NodeManagerAddress"], "error": f"no answer within {timeout_s:g} s"})
        return out
    finally:
        ray.shutdown()


def format_devices(devs: list[dict], indent: str = "  ") -> list[str]:
    def gib(n: int | None) -> str:
        return "?" if n is None else f"{n / 2**30:.1f}"

    lines = []
    for d in devs:
        prec = "/".join(p for p, ok in (("bf16", d["bf16"]), ("fp16", d["fp16"])) if ok) or "fp32 only"
        lines.append(
            f"{indent}{d['kind']}:{d['index']}  {d['name']}  memory {gib(d['total_memory'])} GiB "
            f"(free {gib(d['free_memory'])})  {prec}"
        )
    return lines


def format_status(reports: list[dict]) -> str:
    lines = []
    for r in reports:
        if "error" in r:
            lines.append(f"node {r['ip']}: {r['error']}")
            continue
        v = r["versions"]
        role = "head" if r.get("head") else "worker"
        lines.append(
            f"node {r['ip']} ({r['hostname']}, {role}, {r['os']}): {r['cpus']} CPUs; python {v['python']}, "
            f"torch {v['torch']}, ray {v['ray']}, mixtrain {v['mixtrain']}"
        )
        lines += format_devices(r["devices"])
    return "\n".join(lines)
