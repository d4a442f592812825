"""Real network namespaces, one trap each: a head whose Ray does not enforce the token (`cluster up` must
stop it and say so), and "No route to host" to a machine on the same network while the gateway answers
(macOS Local Network Privacy: `cluster join` and a worker must name the setting)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.multihost import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(MIXTRAIN_HOME=str(home), PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    return env


def _python(host: netns.Host, code: str, home, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        host.cmd(sys.executable, "-c", code, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(home),
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


OPEN_HEAD = """
import sys
from mixtrain.cluster import headnode

real = headnode.auth_env


def ignored(token=None, path=None):  # a Ray that starts without token authentication whatever it is told
    return {**real(token, path), "RAY_AUTH_MODE": "disabled"}


headnode.auth_env = ignored
try:
    headnode.up(port=6379, interface=sys.argv[1], node_ip=None, num_cpus=1, temp_dir=sys.argv[2])
except headnode.ClusterError as exc:
    print("REFUSED:", exc)
else:
    print("STARTED")
"""


def test_up_stops_a_head_that_serves_calls_without_the_token(tmp_path):
    tag = str(os.getpid() % 10000 + 1)
    temp = f"/tmp/mt{tag}o"
    with netns.Network(tag, 1, subnet=78) as net:
        [head] = net.hosts
        try:
            proc = _python(head, OPEN_HEAD, tmp_path / "home", net.interface(0), temp)
            assert "REFUSED: token authentication is NOT enforced" in proc.stdout, proc.stdout + proc.stderr[-3000:]
            assert "the head was stopped" in proc.stdout
            assert not (tmp_path / "home" / "cluster.json").exists()
            deadline = time.monotonic() + 30  # every process of the group is signalled; sockets close as they exit
            while (listening := subprocess.run(head.cmd("ss", "-ltnH"), capture_output=True, text=True).stdout).strip():
                assert time.monotonic() < deadline, listening
                time.sleep(0.2)
        finally:
            shutil.rmtree(temp, ignore_errors=True)


BLOCKED = """
import platform, sys
from mixtrain.cli.main import main
from mixtrain.cluster import headnode  # torch and Ray imported before the platform call is patched
from mixtrain.comm.netif import unreachable_hint
from mixtrain.comm.process_group import RendezvousError, join_group

peer, gateway, token = sys.argv[1:4]
print("CONTROL:", unreachable_hint(gateway, 53), file=sys.stderr)  # it answers (refuses): nothing to explain
for os_name in ("linux", "mac"):
    if os_name == "mac":  # macOS-only wording: the platform call is patched, the network is real
        platform.system = lambda: "Darwin"
    main(["cluster", "join", f"{peer}:7000", "--token-file", token])
    try:
        join_group(
            rank=1, world_size=2, host=peer, port=7000, prefix='p', rendezvous_timeout_s=1, collective_timeout_s=1
        )
    except RendezvousError as exc:
        print("WORKER:", exc, file=sys.stderr)
"""


def test_no_route_to_a_peer_on_the_same_network_while_the_gateway_answers_names_the_setting(tmp_path):
    tag = str(os.getpid() % 10000 + 2)
    with netns.Network(tag, 3, subnet=79) as net:
        peer, mac, gateway = net.hosts
        resolv = Path("/etc/netns") / mac.ns  # `ip netns exec` mounts this over /etc/resolv.conf
        listener = subprocess.Popen(
            peer.cmd(sys.executable, "-c", "import socket,time; s=socket.create_server(('',7000)); time.sleep(300)")
        )
        try:
            token = tmp_path / "auth_token"
            token.write_text("t" * 48)
            # the mac can reach its gateway (which refuses port 53: an answer) but not its neighbour: the
            # kernel rejects the route with EHOSTUNREACH, the errno macOS gives a process without the grant
            subprocess.run(mac.cmd("ip", "route", "add", "default", "via", gateway.ip), check=True)
            subprocess.run(mac.cmd("ip", "route", "add", "unreachable", f"{peer.ip}/32"), check=True)
            # the gateway is no DNS server: name lookups (torch's store makes one) must fail fast, not time out
            resolv.mkdir(parents=True)
            (resolv / "resolv.conf").write_text("nameserver 127.0.0.1\n")
            proc = subprocess.run(
                mac.cmd(sys.executable, "-c", BLOCKED, peer.ip, gateway.ip, str(token)),
                capture_output=True,
                text=True,
                timeout=120,
                env={**_env(tmp_path / "home"), "MIXTRAIN_CONNECT_TIMEOUT_S": "1", "MIXTRAIN_UNREACHABLE_PROBE_S": "2"},
                cwd=REPO,
                stdin=subprocess.DEVNULL,
            )
            lines = proc.stderr.splitlines()
            assert "CONTROL: None" in lines, proc.stderr[-3000:]
            joins = [ln for ln in lines if ln.startswith("mixtrain: error: no Ray head answers")]
            workers = [ln for ln in lines if ln.startswith("WORKER:")]
            assert len(joins) == len(workers) == 2, proc.stderr[-3000:]
            seen = f"{peer.ip} is on this machine's own network ({net.interface(1)}) but gives 'No route to host'"
            for line in (*joins, *workers):
                assert seen in line and f"the gateway {gateway.ip} answers" in line, line
            for line in (joins[0], workers[0]):  # Linux
                assert "Local Network" not in line and "firewall or route" in line
            for line in (joins[1], workers[1]):  # macOS
                assert "Privacy & Security > Local Network" in line and "Terminal" in line
        finally:
            listener.kill()
            listener.wait()
            shutil.rmtree(resolv, ignore_errors=True)
            with contextlib.suppress(OSError):
                resolv.parent.rmdir()  # /etc/netns, if nothing else uses it
