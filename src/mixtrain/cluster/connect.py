"""Connecting to Ray: an existing cluster, or an embedded local one started in seconds."""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from mixtrain._constants import CONNECT_TIMEOUT_S, env_float
from mixtrain.cluster import ray_shim
from mixtrain.errors import InputValueError

SYSTEM_CONFIG: dict[str, Any] = {"free_objects_period_milliseconds": 10, "worker_niceness": 0}
"""Ray settings of the Ray mixtrain starts (embedded here; `cluster up/join` as RAY_<name> variables).

free_objects_period_milliseconds: Ray frees objects nobody holds in batches, once a second by default: the
parameter servers' gradients and answers (tens of MB a step) then pile up in the object store, and every page of
it a worker touched counts in the worker's resident memory (a 12.6M-parameter ps worker: 1.0 GB of shared
pages; 0.2 GB freed every 10 ms).

worker_niceness: Ray runs its workers 15 nice steps below the process that started it by default, where any
process at the usual nice 0 on the same core takes 28 times their CPU time (weights 1024 to 36): a training
worker beside a busy loop got 3% of a core (2026-11-25) where torchrun's ranks get half. 0: the command's own
priority (`nice -n 10 mixtrain ...` still gives 10). Training is the job here, not a background task."""


LEAN_HEAD: dict[str, Any] = {"no_monitor": True, "include_log_monitor": False}
"""Ray processes an embedded Ray goes without (what `ray start --no-monitor --include-log-monitor=False` sets,
which `ray.init` does not pass on): the autoscaler's monitor (one machine has nothing to scale) and the log
monitor (with log_to_driver off nobody reads what it forwards, yet it polls every worker's log files: about 4%
of a core all through a long test session). Their start-up took 2.0 s of CPU from the other processes on a
2-core machine, and the first step came 1.3 s later (2026-11-25).

Nor does it start Ray's API server (the dashboard's head process), which `ray.init` starts even with
include_dashboard=False, to run the usage-statistics module alone (off: RAY_USAGE_STATS_ENABLED=0), and then
waits for: 1.0-1.4 s on a 2-core machine. It serves Ray's job submission, state API and dashboard, none of which
mixtrain's drivers use; `mixtrain cluster up --dashboard` is the way to have them.

Nor does it start the dashboard agent, or wait for it (ray_shim.no_dashboard_agent): the raylet registers the
node with the agent's metrics and HTTP ports "not served" from the start, and runs a stand-in that only lives as
long as the raylet where the agent would be (0.7-0.9 s of CPU at start-up and 118 MB of memory, to serve what
only the API server above and Ray's metrics export use). Where another Ray on the machine held the agent's HTTP
port (two runs at once, a `ray start` cluster, a test session), `ray.init` took 4.65-5.05 s with the agent
awaited and 1.24-1.39 s without; the first step of `compare.py`'s MLP came 0.4-0.6 s sooner without the agent
than with it unawaited, on an idle 2-core machine (2026-12-06)."""


LOCAL_NODE_IP = "127.0.0.1"
"""The embedded Ray's node address. Ray binds its gRPC servers (GCS, raylet, every worker process, the driver)
and its agents to this address when it is loopback, and to every interface otherwise: started with the
machine's LAN address (what `ray.init` picks on Linux), a laptop-only run had 10 of Ray's listeners open to the
network (`ss -ltnp`, Ray 2.60, 2026-11-26); on loopback, none. On macOS and Windows Ray picks loopback itself. The
workers' collectives follow: all on one node, they meet on loopback too (process_group.Rendezvous)."""


REGISTER_POLL_S = 10.0
"""How long the embedded Ray's start asks every 20 ms whether its raylet has registered (0.5-0.6 s on an idle
2-core machine, seconds on a loaded one) before leaving the wait to Ray, which asks once a second."""


def system_env() -> dict[str, str]:
    """SYSTEM_CONFIG as the environment variables a `ray start` reads."""
    return {f"RAY_{name}": str(value) for name, value in SYSTEM_CONFIG.items()}


def ensure_ray(address: str | None, num_cpus_needed: float) -> None:
    """Connect to `address`, or start a quiet local Ray with enough logical CPUs for the workers.

    A Ray that is already initialised in this process (a test session, a notebook) is used as is.
    """
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
    if address is not None:
        check_reachable(address)
        with ray_shim.loopback_as_given():
            ray.init(address=address, **quiet)
        return
    cpus = os.cpu_count() or 1
    if num_cpus_needed > cpus:
        logging.getLogger("mixtrain").warning(
            "the workers reserve %.1f CPUs but this machine has %d: they will share cores", num_cpus_needed, cpus
        )
    start_embedded(num_cpus=max(cpus, math.ceil(num_cpus_needed)), resources=device_resources(), **quiet)


def start_embedded(**init_args: Any) -> None:
    """A new local Ray for this process (`ray.init` keywords in `init_args`), with mixtrain's settings and
    without the processes of LEAN_HEAD."""
    # Ctrl-C in the terminal must reach the driver only, not Ray's own processes
    with (
        _signals_ignored(signal.SIGINT),
        ray_shim.node_params(LOCAL_NODE_IP, LEAN_HEAD),
        ray_shim.lean_head(REGISTER_POLL_S),
        ray_shim.dashboard_deps_found(),
        ray_shim.no_dashboard_agent(),
    ):
        ray.init(
            address="local",  # a new embedded Ray, even where a `ray start` cluster runs on this machine
            include_dashboard=False,
            **ray_shim.init_kwargs(SYSTEM_CONFIG),
            **init_args,
        )


def stop_ray_uninterrupted() -> None:
    """Disconnect from Ray (stopping an embedded one) with SIGINT and SIGTERM ignored, so that another Ctrl-C
    cannot cut the shutdown short: Ray's own processes are stopped and reaped here, not left to an exit handler
    that a signal may interrupt (agents whose raylet lingers as an unreaped zombie never exit)."""
    if ray.is_initialized():
        with _signals_ignored(signal.SIGINT, signal.SIGTERM):
            ray.shutdown()


@contextmanager
def _signals_ignored(*signals: signal.Signals) -> Iterator[None]:
    """`signals` ignored for the block (main thread only: elsewhere handlers cannot be set). Processes started
    meanwhile inherit the ignored SIGINT: a terminal's Ctrl-C goes to its whole foreground process group, and
    Ray's own processes must not die of it (the driver stops gracefully)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def device_resources() -> dict[str, float]:
    """Custom resources that tell CUDA and Apple GPUs apart ("cuda": count, "mps": 1), which
    Ray's "GPU" does not; registered by the embedded Ray and by `mixtrain cluster up/join`."""
    from mixtrain import devices

    out = {}
    for kind in ("cuda", "mps"):
        n = devices.get(kind).count()
        if n:
            out[kind] = float(n)
    return out


def inventory() -> str:
    """The cluster's total and free resources, for error messages."""
    from mixtrain.cluster.placement import format_resources

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    total, free = format_resources(ray.cluster_resources()), format_resources(ray.available_resources())
    return f"{len(nodes)} node(s); total: {total}; free: {free}"


def check_reachable(address: str, timeout_s: float | None = None) -> None:
    """Fail in seconds, naming the address, when no Ray head answers at host:port.

    Ray 2.60's own connect keeps retrying for minutes. "auto" and "ray://" addresses are
    left to Ray.
    """
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise InputValueError(f"address={address!r}: use HOST:PORT of the Ray head (e.g. 192.168.1.10:6379), or 'auto'")
    timeout = env_float(CONNECT_TIMEOUT_S) if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                from mixtrain.comm.netif import unreachable_hint

                hint = unreachable_hint(host, int(port)) if exc.errno == errno.EHOSTUNREACH else None
                raise ConnectionError(
                    f"no Ray head answers at {address} (tried for {timeout:g} s, MIXTRAIN_CONNECT_TIMEOUT_S): {exc}. "
                    + (
                        f"{hint}."
                        if hint
                        else "Check the address that `ray start --head` printed, that the head is running, and that "
                        "no firewall blocks the port; or leave the address out to start a local Ray."
                    )
                ) from exc
            time.sleep(0.5)
