"""Two real hosts (network namespaces on a bridge): `mixtrain cluster up` on one, `cluster join`
on the other (token from a file, never on a command line), what each node listens on (`ss -ltnp`)
and what a stranger on a third host gets from each port, `cluster status`, `mixtrain env`, a
training run across both that matches single-process training, a client without the token
refused, and `cluster down`."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixtrain import __version__ as mixtrain_version
from tests.conftest import REPO
from tests.models import data
from tests.multihost import netns
from tests.ray.test_exactness import NUM_SAMPLES, assert_same_weights, reference
from tests.venvs import linked_venv

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

BIN = os.path.dirname(sys.executable)


def _env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        MIXTRAIN_HOME=str(home),
        PYTHONPATH=str(REPO),
        PATH=f"{BIN}:{env.get('PATH', '')}",
        RAY_USAGE_STATS_ENABLED="0",
        MIXTRAIN_RENDEZVOUS_TIMEOUT_S="30",
    )
    return env


def _run(
    host: netns.Host, argv: list[str], home, timeout: float = 120, stdin: str = "", **extra_env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        host.cmd(*argv),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**_env(home), **extra_env},
        cwd=REPO,
    )


# What a node may listen on, by process, once `cluster up`/`join` is done (Ray 2.60): "*" = every interface.
# Ray's gRPC servers cannot be bound to one address; the rest is on the node's address or loopback.
# Not there: the Ray Client server (10001), the autoscaler monitor's metrics (44217), the dashboard (8265),
# the agents' metrics export.
HEAD_LISTENS = {
    ("*", "gcs_server"): 1,
    ("*", "raylet"): 2,  # node manager, object manager
    ("*", "ray::DashboardA"): 1,  # the agent's gRPC server
    ("node", "ray::DashboardA"): 1,  # its HTTP server
    ("127.0.0.1", "ray::DashboardA"): 1,
    ("node", "ray::RuntimeEnv"): 1,
    ("*", "python"): 1,  # the dashboard process's own Prometheus page, 44227 (no switch in Ray 2.60)
}
WORKER_LISTENS = {k: n for k, n in HEAD_LISTENS.items() if k[1] not in ("gcs_server", "python")}


def _listening(host: netns.Host) -> list[dict]:
    """`ss -ltnp` inside the host's namespace: address ("*" for every interface), port, process."""
    out = subprocess.run(host.cmd("ss", "-ltnpH"), capture_output=True, text=True, check=True).stdout
    sockets = []
    for line in out.splitlines():
        local = line.split()[3]
        ip, _, port = local.rpartition(":")
        ip = ip.strip("[]").removeprefix("::ffff:")
        owner = re.search(r'users:\(\("([^"]+)"', line)
        sockets.append(
            {
                "ip": "*" if ip in ("*", "0.0.0.0", "::") else ip,
                "port": int(port),
                # the interpreter's name follows how the venv was made (python3, python3.11): one name for all
                "process": re.sub(r"^python[\d.]*$", "python", owner.group(1)) if owner else "?",
            }
        )
    return sockets


def _shape(sockets: list[dict], node_ip: str) -> dict:
    counts: dict = {}
    for s in sockets:
        key = ("node" if s["ip"] == node_ip else s["ip"], s["process"])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _settled(host: netns.Host, want: dict) -> list[dict]:
    """The node's listening sockets once Ray's processes have all come up (they start after `up` returns)."""
    deadline = time.monotonic() + 60
    while True:
        sockets = _listening(host)
        if _shape(sockets, host.ip) == want or time.monotonic() > deadline:
            return sockets
        time.sleep(0.5)


def _probe_from(stranger: netns.Host, nodes: list[tuple[netns.Host, list[dict]]], home) -> list[dict]:
    """Each port of `nodes` ((host, its sockets) pairs) reachable from the LAN, called by `stranger` without a
    token."""
    reachable = [
        {**s, "ip": node.ip, "every_interface": s["ip"] == "*"}
        for node, sockets in nodes
        for s in sockets
        if s["ip"] in ("*", node.ip)
    ]
    probe = _run(stranger, [sys.executable, "tests/multihost/probe_ports.py", json.dumps(reachable)], home)
    assert probe.returncode == 0, probe.stderr[-2000:]
    return [json.loads(line) for line in probe.stdout.splitlines()]


def _only_metrics_page_answers_without_a_token(answers: list[dict]) -> None:
    for a in answers:
        what = f"{a['process']} on {a['ip']}:{a['port']}: {a}"
        if a["port"] == 44227:  # read-only metrics of the dashboard process: open, documented in the README
            assert a["http"] == "200", what
        elif a["grpc"]:
            assert "ACCEPTED" not in a["grpc"] and "UNAUTHENTICATED" in a["grpc"], what
        else:  # the agents' HTTP servers
            assert a["http"] == "401", what


def test_cluster_up_join_train_across_two_hosts_and_refuse_a_client_without_token_or_of_another_release(tmp_path):
    tag = str(os.getpid() % 10000)
    homes = {name: tmp_path / name for name in ("head", "mac", "intruder")}
    mixtrain = os.path.join(BIN, "mixtrain")
    with netns.Network(tag, 3) as net:
        head, other, intruder = net.hosts
        try:
            up = _run(
                head,
                [
                    mixtrain,
                    "cluster",
                    "up",
                    "--interface",
                    net.interface(0),
                    "--num-cpus",
                    "1",
                    "--temp-dir",
                    f"/tmp/mt{tag}a",
                ],
                homes["head"],
            )
            assert up.returncode == 0, up.stderr + up.stdout
            address = f"{head.ip}:6379"
            assert f"head running at {address}" in up.stdout
            assert "a call without the token was refused" in up.stdout
            token_file = homes["head"] / "auth_token"
            token = token_file.read_text()
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            assert token not in up.stdout + up.stderr and f"join {address} --token-file auth_token" in up.stdout
            copied = tmp_path / "auth_token"  # as scp would bring it to the other machine
            copied.write_text(token)

            joined = _run(
                other,
                [
                    mixtrain,
                    "cluster",
                    "join",
                    address,
                    "--token-file",
                    str(copied),
                    "--num-cpus",
                    "1",
                    "--temp-dir",
                    f"/tmp/mt{tag}b",
                ],
                homes["mac"],
            )
            assert joined.returncode == 0, joined.stderr + joined.stdout
            assert f"joined {address} as {other.ip}" in joined.stdout
            assert "warning" not in joined.stderr
            # no process on the machine carries the token in its arguments (Ray's own included)
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    assert token.encode() not in cmdline.read_bytes(), cmdline
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    pass

            # what each node listens on, and what a stranger on the third host gets from each port
            head_sockets = _settled(head, HEAD_LISTENS)
            other_sockets = _settled(other, WORKER_LISTENS)
            assert _shape(head_sockets, head.ip) == HEAD_LISTENS, head_sockets
            assert _shape(other_sockets, other.ip) == WORKER_LISTENS, other_sockets
            assert {s["port"] for s in head_sockets} & {10001, 44217, 8265} == set()
            assert [s["port"] for s in head_sockets if s["process"] == "python"] == [44227]
            answers = _probe_from(intruder, [(head, head_sockets), (other, other_sockets)], homes["intruder"])
            assert len(answers) == 12  # every socket not on loopback: 7 on the head, 5 on the other host
            _only_metrics_page_answers_without_a_token(answers)

            env = _run(head, [mixtrain, "env"], homes["head"])
            assert env.returncode == 0, env.stderr
            assert f"ray auth: token required: the GCS at {address} refused a call without the token" in env.stdout
            assert "*:6379  gcs_server" in env.stdout and f"{head.ip}:" in env.stdout
            assert f"token file {token_file} (0600)" in env.stdout

            status = _run(head, [mixtrain, "cluster", "status"], homes["head"])
            assert status.returncode == 0, status.stderr
            assert f"node {head.ip}" in status.stdout and f"node {other.ip}" in status.stdout
            assert "cpu:0" in status.stdout and "torch 2." in status.stdout

            out = tmp_path / "train"
            out.mkdir()
            train = _run(
                head,
                [sys.executable, "tests/multihost/train_two_hosts.py", address, str(out)],
                homes["head"],
                timeout=240,
            )
            assert train.returncode == 0, train.stderr[-4000:]
            workers = json.loads((out / "workers.json").read_text())
            assert sorted(w["host"] for w in workers) == [head.ip, other.ip]
            # both workers' output is in the run folder: the head's written there, the other node's copied back
            logs = sorted((out / "run" / "logs").glob("worker-*.log"))
            assert len(logs) == 2 and all("asking for cpu" in p.read_text() for p in logs), logs
            x, y = data("mlp", NUM_SAMPLES)
            assert_same_weights(torch.load(out / "weights.pt", weights_only=True), reference("mlp", "sgd", x, y))

            # a third host without the token is refused, and says so, within seconds
            probe = f"import ray; ray.init(address='{address}', logging_level='ERROR'); print('CONNECTED')"
            refused = _run(intruder, [sys.executable, "-c", probe], homes["intruder"], timeout=90)
            assert "CONNECTED" not in refused.stdout
            assert refused.returncode != 0
            assert re.search(r"(?i)token|auth", refused.stderr), refused.stderr[-2000:]
            wrong = _run(
                intruder, [mixtrain, "cluster", "join", address, "--token-file", "-"], homes["intruder"], stdin="0" * 48
            )
            assert wrong.returncode == 1
            assert "could not read the head's version card" in wrong.stderr and "--token-file" in wrong.stderr

            # a machine with another mixtrain release (a real second virtual environment: this one's torch and
            # Ray, a copy of mixtrain that says 0.1.99), with the right token, is refused naming the versions
            python, site = linked_venv(tmp_path, lambda name: name != "mixtrain", name="other-release")
            shutil.copytree(REPO / "src" / "mixtrain", site / "mixtrain", ignore=shutil.ignore_patterns("__pycache__"))
            init = site / "mixtrain" / "__init__.py"
            init.write_text(init.read_text().replace(f'__version__ = "{mixtrain_version}"', '__version__ = "0.1.99"'))
            other_release = _run(
                intruder,
                [str(python), "-m", "mixtrain.cli.main", "cluster", "join", address, "--token-file", str(copied)],
                homes["intruder"],
            )
            assert other_release.returncode == 1, other_release.stderr + other_release.stdout
            assert (
                f"refusing to join: mixtrain: the head has {mixtrain_version}, this machine has 0.1.99"
                in other_release.stderr
            ), other_release.stderr
        finally:
            for host, name in ((other, "mac"), (head, "head")):
                down = _run(host, [mixtrain, "cluster", "down"], homes[name])
                assert down.returncode == 0, down.stderr
            for side in "ab":
                shutil.rmtree(f"/tmp/mt{tag}{side}", ignore_errors=True)
        assert "stopped the Ray head" in down.stdout
