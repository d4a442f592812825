"""Which network interface the collectives use.

Without GLOO_SOCKET_IFNAME, gloo picks its interface by resolving the machine's hostname,
and many Linux installs map the hostname to 127.0.1.1 in /etc/hosts: gloo then listens on
loopback and peers on other machines hang. mixtrain names the interface that holds the
node's Ray address instead, unless the user set one.
"""

from __future__ import annotations

import os
import socket


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


def pin_interface(ip: str, backend: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME for NCCL) to the interface of `ip` unless
    already set (by the user or the network_interface setting); returns the name in use."""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        return os.environ[var]
    name = interface_for(ip)
    if name is not None:
        os.environ[var] = name
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
