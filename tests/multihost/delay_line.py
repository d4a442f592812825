"""A delay line between two network-namespace hosts, for a kernel without sch_netem (this one: tc knows no
netem, fq, cake or etf, so no qdisc can add delay). Needs root.

`python -m tests.multihost.delay_line DEV_A DEV_B ONE_WAY_MS` joins two interfaces in the root namespace
(the outer ends of the hosts' veth pairs, taken off their bridge first: `Delayed` does that) with a wire that
holds every frame ONE_WAY_MS before it passes it on, in order: a round trip then takes twice that on top of
what the link already costs. Frames are moved whole with their virtio-net header (PACKET_VNET_HDR), so the
kernel's large TCP segments and checksums the sender left to "the hardware" cross as they are, not dropped.
Rate limits stay where they are (tbf on each host's egress, before the line). It prints "ready" once both
sockets are bound and, when stopped (SIGTERM), one line with the frames and bytes it moved each way.

One process in Python: at the rates it is used for (at most about 100 Mbit/s, large segments) it moves a few
thousand frames a second, a few percent of a core; that core is one the hosts share, which the benchmark that
uses it says.
"""

from __future__ import annotations

import collections
import contextlib
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33  # (Linux; Python's socket module does not name them)
FRAME_MAX = 10 + 65536 + 14  # virtio-net header, the largest GSO segment, the Ethernet header


def _socket(dev: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    for option in (SO_RCVBUFFORCE, SO_SNDBUFFORCE):  # a burst waits here, not dropped, while we
        sock.setsockopt(socket.SOL_SOCKET, option, 8 << 20)  # hold frames
    sock.bind((dev, 0))
    sock.setblocking(False)
    return sock


def run(dev_a: str, dev_b: str, one_way_s: float) -> None:
    a, b = _socket(dev_a), _socket(dev_b)
    peer = {a.fileno(): b, b.fileno(): a}
    held: dict[int, collections.deque[tuple[float, bytes]]] = {
        a.fileno(): collections.deque(),
        b.fileno(): collections.deque(),
    }
    moved = {a.fileno(): [0, 0], b.fileno(): [0, 0]}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print("ready", flush=True)
    while not stop:
        now = time.monotonic()
        due = [q[0][0] for q in held.values() if q]
        timeout = max(0.0, min(due) - now) if due else 0.5
        try:
            readable, _, _ = select.select([a, b], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for sock in readable:
            while True:
                try:
                    frame, address = sock.recvfrom(FRAME_MAX)
                except BlockingIOError:
                    break
                if address[2] == socket.PACKET_OUTGOING:  # what this line itself sent out of that interface
                    continue
                held[sock.fileno()].append((now + one_way_s, frame))
        now = time.monotonic()
        for fd, queue in held.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    peer[fd].send(frame)
                except (BlockingIOError, OSError):
                    pass  # a full queue on the far side drops it, as a wire would; TCP sends it again
                moved[fd][0] += 1
                moved[fd][1] += len(frame)
    print(f"moved {dev_a}->{dev_b}: {moved[a.fileno()]}, {dev_b}->{dev_a}: {moved[b.fileno()]}", flush=True)


@contextlib.contextmanager
def delayed(outer: tuple[str, str], bridge: str, one_way_ms: float) -> Iterator[None]:
    """The two interfaces `outer` off `bridge` and joined by a delay line of `one_way_ms` each way while the
    block runs; back on the bridge after it (live connections carry on: the same addresses, the same path)."""
    if one_way_ms <= 0:
        yield
        return
    for dev in outer:
        subprocess.run(["ip", "link", "set", dev, "nomaster"], check=True)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.multihost.delay_line", *outer, str(one_way_ms)],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay line between {outer} did not start (exit {proc.wait(10)})")
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()
        for dev in outer:
            subprocess.run(["ip", "link", "set", dev, "master", bridge], check=False)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m tests.multihost.delay_line DEV_A DEV_B ONE_WAY_MS")
    run(sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1e3)
