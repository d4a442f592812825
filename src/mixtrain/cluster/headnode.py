"""Start, join, inspect and stop a mixtrain Ray cluster: `mixtrain cluster up|join|status|down`.

Each node runs `ray start --block` as a detached process group that this module records in
$MIXTRAIN_HOME/cluster.json (default ~/.mixtrain), so `down` stops exactly the processes
`up`/`join` started: never `ray stop`, which kills every Ray on the machine. Token
authentication is always on; the token lives in $MIXTRAIN_HOME/auth_token (mode 0600).
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mixtrain import compat
from mixtrain._constants import RAY_READY_TIMEOUT_S, env_float
from mixtrain.cluster.connect import check_reachable, device_resources
from mixtrain.comm.netif import hostname_trap, ipv4_addresses
from mixtrain.compat import version_mismatches

CARD_KEY, CARD_NS = b"head", b"mixtrain"


class ClusterError(RuntimeError):
    """A cluster command could not do its work; the message says why and what to do."""


def home() -> Path:
    path = Path(os.environ.get("MIXTRAIN_HOME", Path.home() / ".mixtrain"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(kw_only=True)
class NodeState:
    role: str  # "head" or "worker"
    address: str  # the head's GCS address, HOST:PORT
    node_ip: str
    pgid: int
    log: str


def load_state() -> NodeState | None:
    path = home() / "cluster.json"
    return NodeState(**json.loads(path.read_text())) if path.exists() else None


def _save_state(state: NodeState) -> None:
    (home() / "cluster.json").write_text(json.dumps(asdict(state), indent=2))


def token_path() -> Path:
    return home() / "auth_token"


def _write_token(token: str) -> Path:
    path = token_path()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def auth_env(token: str | None = None) -> dict[str, str]:
    """Environment for a Ray process or driver of this cluster: token mode, token from our file."""
    if token is not None:
        _write_token(token)
    if not token_path().exists():
        raise ClusterError(
            f"no cluster token in {token_path()}: on the head, run `mixtrain cluster up`; elsewhere pass the "
            "token that `cluster up` printed (--token), or set RAY_AUTH_TOKEN"
        )
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path())}


def apply_auth_env(env: dict[str, str]) -> None:
    """Put the token settings into this process. Ray reads them once, when it is imported, so its
    config and token cache are reloaded too (as Ray's own test utilities do)."""
    os.environ.update(env)
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # another Ray: the environment alone must do
        pass


def use_cluster_token(address: str) -> None:
    """For a driver (`mixtrain train --address`): use this machine's cluster token for its own
    cluster's address unless the user set one."""
    state = load_state()
    if state is not None and state.address == address and not os.environ.get("RAY_AUTH_TOKEN"):
        apply_auth_env(auth_env())


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
    """The address other nodes reach this one at; refuses loopback (the 127.0.1.1 trap)."""
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


def _ray_cmd() -> list[str]:
    sibling = Path(sys.executable).with_name("ray")
    return [str(sibling)] if sibling.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            _ray_cmd() + args,
            stdout=out,
            stderr=subprocess.STDOUT,
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
        _kill_group(proc.pid)
        raise


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _kill_group(pgid: int, timeout_s: float = 20.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _common_args(node_ip: str, num_cpus: int | None, temp_dir: str | None) -> list[str]:
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
    """Ray's GCS client (internal API, used by Ray's own CLI): KV access without starting a driver."""
    import ray._raylet

    return ray._raylet.GcsClient(address=address)  # type: ignore[attr-defined]


def _refuse_if_running() -> None:
    state = load_state()
    if state is not None:
        try:
            os.killpg(state.pgid, 0)
        except ProcessLookupError:
            return
        raise ClusterError(
            f"this machine already runs a mixtrain Ray {state.role} for {state.address} (process group "
            f"{state.pgid}); run `mixtrain cluster down` first"
        )


def up(
    *, port: int, interface: str | None, node_ip: str | None, num_cpus: int | None, temp_dir: str | None
) -> NodeState:
    _refuse_if_running()
    ip = pick_node_ip(interface, node_ip, None)
    env = auth_env(secrets.token_hex(24))
    if interface:
        env.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)
    log = home() / "ray-head.log"
    args = ["start", "--head", f"--port={port}", "--dashboard-host=127.0.0.1", *_common_args(ip, num_cpus, temp_dir)]
    proc = _spawn(args, env, log)
    address = f"{ip}:{port}"
    apply_auth_env(env)

    def ready() -> bool:
        try:
            check_reachable(address, timeout_s=0.5)
            gcs = _gcs(address)
            card = json.dumps({**compat.versions(), "os": platform.system()}).encode()
            gcs.internal_kv_put(CARD_KEY, card, True, CARD_NS)
            return True
        except (ConnectionError, RuntimeError, OSError):
            return False

    _wait_started(proc, log, ready)
    state = NodeState(role="head", address=address, node_ip=ip, pgid=proc.pid, log=str(log))
    _save_state(state)
    return state


def head_card(address: str) -> dict[str, str]:
    """The versions `cluster up` recorded on the head."""
    raw = _gcs(address).internal_kv_get(CARD_KEY, CARD_NS)
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
            f"could not read the head's version card at {address}: {exc}. Check the token that "
            "`mixtrain cluster up` printed (--token)."
        ) from exc
    problems = parity_problems(card, compat.versions())
    if problems:
        raise ClusterError(
            "refusing to join: " + "; ".join(problems) + ". Install the same versions here (for Python: a "
            f"virtual environment with Python {card.get('python')}, e.g. `uv venv -p {card.get('python')}`)."
        )
    if platform.system() == "Darwin":
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        print(
            "note: Ray supports macOS nodes in a multi-node cluster only at your own risk "
            "(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 is set for this node).",
            file=sys.stderr,
        )
    ip = pick_node_ip(interface, node_ip, address.rpartition(":")[0])
    if interface:
        env.update(GLOO_SOCKET_IFNAME=interface, NCCL_SOCKET_IFNAME=interface)
    log = home() / "ray-worker.log"
    offset = log.stat().st_size if log.exists() else 0
    proc = _spawn(["start", f"--address={address}", *_common_args(ip, num_cpus, temp_dir)], env, log)

    def ready() -> bool:
        return "Ray runtime started" in log.read_text(errors="replace")[offset:]

    _wait_started(proc, log, ready)
    state = NodeState(role="worker", address=address, node_ip=ip, pgid=proc.pid, log=str(log))
    _save_state(state)
    return state


def down() -> NodeState | None:
    """Stop the Ray processes this machine's `up`/`join` started; None when there were none."""
    state = load_state()
    if state is None:
        return None
    _kill_group(state.pgid)
    (home() / "cluster.json").unlink(missing_ok=True)
    return state


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
