"""Which network interface the collectives use.

Without GLOO_SOCKET_IFNAME, gloo picks its interface by resolving the machine's hostname,
and many Linux installs map the hostname to 127.0.1.1 in /etc/hosts: gloo then listens on
loopback and peers on other machines hang. mixtrain names the interface that holds the
node's Ray address instead, unless the user set one; and loopback when every worker is on one
node, so that gloo (which has no authentication) is not reachable from the network.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import platform
import socket
import subprocess
from pathlib import Path

from mixtrain._constants import UNREACHABLE_PROBE_S, env_float


def ipv4_addresses() -> dict[str, list[str]]:
    """Every local interface with its IPv4 addresses (empty when psutil is missing)."""
    try:
        import psutil  # a dependency of ray[default]
    except ImportError:
        return {}
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }


def interface_for(ip: str) -> str | None:
    """The name of the local interface that holds `ip`, or None."""
    return next((name for name, ips in ipv4_addresses().items() if ip in ips), None)


LOOPBACK = "127.0.0.1"


def is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:  # a host name
        return False


_pinned: dict[str, str] = {}
"""What pin_interface set in this process, by variable: a value still equal to it is mixtrain's to change."""


def pin_interface(ip: str, backend: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME for NCCL) to the interface of `ip` unless the user set
    it (or the network_interface setting did); returns the name in use. Called at every formation: one all on
    this node uses loopback, the next may span nodes."""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    current = os.environ.get(var)
    if current and current != _pinned.get(var):
        return current
    name = interface_for(ip)
    if name is None:
        os.environ.pop(var, None)
        _pinned.pop(var, None)
    else:
        os.environ[var] = _pinned[var] = name
    return name


def hostname_trap() -> str | None:
    """A warning when this machine's hostname resolves to a loopback address (the 127.0.1.1 trap)."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return f"hostname {host!r} does not resolve (macOS '.local' names need mDNS): mixtrain uses IP addresses"
    if addr.startswith("127."):
        return f"hostname {host!r} resolves to {addr} (loopback)"
    return None


# ---- "No route to host" to a machine on the same network: macOS Local Network Privacy -------------------
LOCAL_NETWORK_SETTING = "System Settings > Privacy & Security > Local Network"


def default_gateway() -> str | None:
    """This machine's default IPv4 gateway: Linux's routing table, else `route -n get default` (macOS)."""
    table = Path("/proc/net/route")
    if table.is_file():
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 2 and fields[1] == "00000000" and fields[2] != "00000000":
                return socket.inet_ntoa(int(fields[2], 16).to_bytes(4, "little"))
        return None
    try:
        out = subprocess.run(["route", "-n", "get", "default"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.strip().startswith("gateway:")), None)


def same_network(peer: str) -> str | None:
    """The local interface whose IPv4 network holds `peer` (None: the peer is reached through a router)."""
    try:
        import psutil

        target = ipaddress.IPv4Address(peer)
        for name, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family == socket.AF_INET and a.netmask and a.address != peer:
                    if target in ipaddress.IPv4Network(f"{a.address}/{a.netmask}", strict=False):
                        return name
    except (ImportError, ValueError):
        pass
    return None


def _connect_errno(host: str, port: int, timeout_s: float) -> int:
    """0 when a TCP connection opens, else the errno (ETIMEDOUT when nothing answered in time)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return 0
    except TimeoutError:
        return errno.ETIMEDOUT
    except OSError as exc:
        return exc.errno or errno.EIO


def unreachable_hint(host: str, port: int) -> str | None:
    """Why `host:port` cannot be reached, when it is the pattern this names: a peer on this machine's own
    network refused with "No route to host" while the default gateway answers. On macOS 15+ that is Local
    Network Privacy: the app this process was started from may not talk to the local network. None when the
    pattern does not hold (or `host` answers)."""
    probe_s = env_float(UNREACHABLE_PROBE_S)
    if _connect_errno(host, port, probe_s) != errno.EHOSTUNREACH:
        return None
    interface, gateway = same_network(host), default_gateway()
    if interface is None or gateway is None or gateway == host:
        return None
    if _connect_errno(gateway, 53, probe_s) not in (0, errno.ECONNREFUSED):  # a refusal is an answer too
        return None
    seen = (
        f"{host} is on this machine's own network ({interface}) but gives 'No route to host', while the "
        f"gateway {gateway} answers"
    )
    if platform.system() == "Darwin":
        return (
            f"{seen}: macOS Local Network Privacy blocks this process. Open {LOCAL_NETWORK_SETTING} and turn it "
            "on for the app you started mixtrain from (Terminal, iTerm, your IDE; for a launchd job, its "
            "program), then start it again (if the other machine is asleep, wake it first)"
        )
    return f"{seen}: the other machine is off or asleep, or a firewall or route rejects this one"
