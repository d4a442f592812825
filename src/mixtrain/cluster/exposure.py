"""What a mixtrain Ray node opens to the network, and the `ray start` settings that keep it small.

Measured on Ray 2.60 (`ss -ltnp` inside a network namespace; the multi-host test checks it on every run):
Ray's C++ gRPC servers (GCS, the raylet's node and object managers, each worker process) listen on every
interface and have no option to bind one; they require the token. What mixtrain does not use is not
started: the Ray Client server (port 10001), the autoscaler monitor and its metrics page (44217), the
dashboard (unless `cluster up --dashboard`; then on 127.0.0.1), the agents' metrics export, the log
monitor. What is left is listed in docs/security.md with a firewall rule.
"""

from __future__ import annotations

import os
from typing import Any

HOOK = "mixtrain.cluster.ray_hook.harden"
"""RAY_START_HOOK: `ray start` calls it with its parameters before starting anything (see ray_hook)."""


def ray_start_args(*, head: bool, dashboard: bool = False) -> list[str]:
    """`ray start` flags that turn off what mixtrain does not use."""
    # mixtrain's drivers connect with log_to_driver off (worker logs come to the run folder its own way), so
    # nobody reads what a log monitor forwards; it polls every worker's log files on each node all the same
    no_log_monitor = "--include-log-monitor=false"
    if not head:
        return [no_log_monitor]
    return [
        f"--include-dashboard={'true' if dashboard else 'false'}",
        "--dashboard-host=127.0.0.1",  # Ray's default too; said here so no default can change it
        "--no-monitor",  # the autoscaler: a hand-made cluster has nothing to scale; it serves metrics on 44217
        no_log_monitor,
    ]


def ray_start_env(*, head: bool) -> dict[str, str]:
    """Environment for `ray start` (and so every Ray process of the node)."""
    env = {
        "RAY_enable_metrics_collection": "false",  # no Prometheus export from the agents
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    if head:  # only a head starts the Ray Client server (the hook imports mixtrain: seconds, so only here)
        env["RAY_START_HOOK"] = HOOK
    return env


def _processes(pgid: int) -> list[Any]:
    """The processes of group `pgid` and all their descendants (Ray's workers start in other groups)."""
    import psutil

    found: dict[int, Any] = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                found[proc.pid] = proc
                found.update((c.pid, c) for c in proc.children(recursive=True))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return list(found.values())


def listening(pgid: int) -> list[dict[str, Any]]:
    """Every TCP socket that the processes of group `pgid` (and their children) listen on, for `mixtrain
    env`: address, port, process name, and whether it is open on every interface."""
    import psutil

    out = []
    for proc in _processes(pgid):
        try:
            name = proc.name()
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                ip = c.laddr.ip.removeprefix("::ffff:")
                out.append({"ip": ip, "port": c.laddr.port, "process": name, "all": ip in ("0.0.0.0", "::")})
    return sorted(out, key=lambda s: (s["port"], s["ip"]))
