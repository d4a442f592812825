"""The delay line the slow-link benchmark uses for latency (this kernel has no netem): between two real
namespace hosts, a round trip takes twice the one-way delay more than over the bridge, a bulk TCP transfer
arrives whole behind a token bucket, and taking the line away gives the bridge back to live connections."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.multihost import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

ECHO = """
import socket, threading

def serve(conn):
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        if data.startswith(b"bulk"):  # count the bulk bytes, then answer with the total
            total, want = len(data) - 4, int(data[4:16])
            while total < want + 12:
                total += len(conn.recv(1 << 20))
            conn.sendall(b"%012d" % (total - 12))
        else:
            conn.sendall(data)

srv = socket.create_server(("0.0.0.0", 7301))
print("listening", flush=True)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""

# One connection before the line, kept through it and after it; a second one made while the line is in place
# for the bulk transfer (a connection's congestion control remembers the round trip it began with: BBR's
# minimum RTT is kept 10 s, so a bulk transfer on the first one would be held to the bridge's window).
CLIENT = """
import json, socket, sys, time

def connect():
    conn = socket.create_connection((sys.argv[1], 7301), timeout=20)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn

def rtts(conn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(1)
        out.append(time.perf_counter() - t0)
    return sorted(out)[n // 2]

kept = connect()
print(json.dumps({"rtt": rtts(kept, 20)}), flush=True)
sys.stdin.readline()  # the test puts the delay line in between
new = connect()
size = 4 << 20
t0 = time.perf_counter()
new.sendall(b"bulk" + b"%012d" % size + b"\\0" * size)
got = int(new.recv(12))
bulk_s = time.perf_counter() - t0
print(json.dumps({"rtt": rtts(kept, 20), "new_rtt": rtts(new, 10), "bulk_s": bulk_s, "bulk_bytes": got}), flush=True)
sys.stdin.readline()  # the line is gone again
print(json.dumps({"rtt": rtts(kept, 20)}), flush=True)
"""


def test_the_delay_line_adds_its_round_trip_and_carries_bulk_tcp_behind_a_token_bucket():
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with netns.Network("dl", 2, subnet=79) as net:
        server = subprocess.Popen(
            net.hosts[0].cmd(sys.executable, "-c", ECHO), stdout=subprocess.PIPE, text=True, env=env
        )
        client = None
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "listening"
            for i, host in enumerate(net.hosts):  # 100 Mbit/s each way, as the benchmark shapes it
                dev = ["tc", "qdisc", "replace", "dev", net.interface(i), "root"]
                subprocess.run(
                    host.cmd(*dev, "tbf", "rate", "100mbit", "burst", "64kb", "latency", "100ms"), check=True
                )
            client = subprocess.Popen(
                net.hosts[1].cmd(sys.executable, "-c", CLIENT, net.hosts[0].ip),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert client.stdin is not None and client.stdout is not None

            def read() -> dict:
                line = client.stdout.readline()
                assert line, "the client ended early"
                return json.loads(line)

            bridge = read()["rtt"]
            with net.delayed(10.0):
                client.stdin.write("\n")
                client.stdin.flush()
                moved = read()
                line_rtt = moved["rtt"]
            client.stdin.write("\n")
            client.stdin.flush()
            after = read()["rtt"]
        finally:
            for proc in (client, server):
                if proc is not None:
                    proc.kill()
                    proc.wait(10)
    print("round trips: bridge", bridge, "line", line_rtt, "bulk", moved, "after", after)
    assert bridge < 0.005, bridge
    assert 0.020 <= line_rtt < 0.020 + 0.015, (bridge, line_rtt)  # 10 ms each way, and little more
    assert moved["bulk_bytes"] == 4 << 20
    # 4 MiB at 100 Mbit/s is 0.34 s; a 20 ms round trip adds TCP's start (some round trips) and no more
    assert 0.34 < moved["bulk_s"] < 0.34 + 20 * 0.020, moved
    assert 0.020 <= moved["new_rtt"] < 0.035, moved
    assert after < 0.005, after  # the bridge again, for the same connection


def test_a_delay_of_zero_leaves_the_bridge_alone():
    with netns.Network("dz", 2, subnet=80) as net, net.delayed(0):
        out = subprocess.run(["ip", "link", "show", "master", net.bridge], capture_output=True, text=True)
        assert f"mt{net.tag}v0" in out.stdout and f"mt{net.tag}v1" in out.stdout
