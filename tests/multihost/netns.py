"""Real separate hosts for tests: Linux network namespaces on one bridge (needs root).

Each host has its own network stack and loopback; they share the filesystem, so every Ray
node gets its own --temp-dir and every mixtrain node its own MIXTRAIN_HOME.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass


def available() -> str | None:
    """None when network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Host:
    ns: str
    ip: str

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


class Network:
    """`count` hosts 10.77.N.1.. on a bridge; tc netem can shape a host's link later."""

    def __init__(self, tag: str, count: int, subnet: int = 77) -> None:
        self.tag = tag
        self.bridge = f"mtbr{tag}"
        self.hosts = [Host(f"mt{tag}h{i}", f"10.{subnet}.0.{i + 1}") for i in range(count)]
        self.subnet = subnet

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, h in enumerate(self.hosts):
                outer, inner = f"mt{self.tag}v{i}", f"mt{self.tag}p{i}"
                _ip("netns", "add", h.ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", h.ns)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("netns", "exec", h.ns, "ip", "addr", "add", f"{h.ip}/24", "dev", inner)
                _ip("netns", "exec", h.ns, "ip", "link", "set", inner, "up")
                _ip("netns", "exec", h.ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def interface(self, index: int) -> str:
        return f"mt{self.tag}p{index}"

    def delayed(self, one_way_ms: float) -> contextlib.AbstractContextManager[None]:
        """While the block runs, hosts 0 and 1 are joined by a delay line of `one_way_ms` each way instead of
        the bridge (delay_line.py: this kernel has no netem)."""
        from tests.multihost.delay_line import delayed

        return delayed((f"mt{self.tag}v0", f"mt{self.tag}v1"), self.bridge, one_way_ms)

    def __exit__(self, *exc: object) -> None:
        for i, h in enumerate(self.hosts):
            _ip("netns", "delete", h.ns, check=False)
            _ip("link", "delete", f"mt{self.tag}v{i}", check=False)
        _ip("link", "delete", self.bridge, check=False)
