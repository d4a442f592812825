"""Two real hosts (network namespaces on a bridge): `mixtrain cluster up` on one, `cluster join`
on the other, `cluster status`, a training run across both that matches single-process
training, a client without the token refused from a third host, and `cluster down`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.models import data
from tests.multihost import netns
from tests.ray.test_exactness import NUM_SAMPLES, assert_same_weights, reference

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


def _run(host: netns.Host, argv: list[str], home, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        host.cmd(*argv), capture_output=True, text=True, timeout=timeout, env=_env(home), cwd=REPO, check=False
    )


def test_cluster_up_join_train_across_two_hosts_and_refuse_a_client_without_token(tmp_path):
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
            token = re.search(r"--token (\S+)", up.stdout).group(1)  # type: ignore[union-attr]

            joined = _run(
                other,
                [
                    mixtrain,
                    "cluster",
                    "join",
                    address,
                    "--token",
                    token,
                    "--num-cpus",
                    "1",
                    "--temp-dir",
                    f"/tmp/mt{tag}b",
                ],
                homes["mac"],
            )
            assert joined.returncode == 0, joined.stderr + joined.stdout
            assert f"joined {address} as {other.ip}" in joined.stdout

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
            wrong = _run(intruder, [mixtrain, "cluster", "join", address, "--token", "0" * 48], homes["intruder"])
            assert wrong.returncode == 1
            assert "could not read the head's version card" in wrong.stderr and "--token" in wrong.stderr
        finally:
            for host, name in ((other, "mac"), (head, "head")):
                down = _run(host, [mixtrain, "cluster", "down"], homes[name])
                assert down.returncode == 0, down.stderr
            for side in "ab":
                shutil.rmtree(f"/tmp/mt{tag}{side}", ignore_errors=True)
        assert "stopped the Ray head" in down.stdout
