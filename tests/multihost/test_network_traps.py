"""Real network namespaces, one trap each: a head whose Ray does not enforce the token (`cluster up` must
stop it and say so)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

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


def ignored(token=None):  # a Ray that starts without token authentication whatever it is told
    return {**real(token), "RAY_AUTH_MODE": "disabled"}


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
