"""A network partition between two real hosts (network namespaces on a bridge): the other host's cable
is pulled twice while a run trains across both. Down for 10 s: TCP carries on once it is back, and
nobody is declared lost. Down for longer than the configured timeouts: its worker is declared lost within
them, the run goes on with the head's worker, and once the link is back the host joins again and its new
worker is taken back at a round boundary. Nothing is lost: the weights are one process's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import run_records
from tests.models import data
from tests.multihost import netns
from tests.multihost.test_two_hosts import BIN, _env, _run
from tests.multihost.train_partition import NUM_SAMPLES
from tests.ray.test_exactness import assert_same_weights, reference

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

# A drop of D seconds costs nothing while the collective timeout is over D plus TCP's retransmission backoff
# (doubling from 0.2 s: after a 10 s drop the next retry comes at 12.6 s; a 12 s timeout fired in a trial)
COLLECTIVE_TIMEOUT_S = 25  # MIXTRAIN_COLLECTIVE_TIMEOUT_S in this test (60 by default)
LOST_GRACE_S = 3  # MIXTRAIN_LOST_GRACE_S (15 by default)
# Ray's GCS declares a silent node dead after this many failed health checks, each up to its timeout plus
# the period (about 21 s here, well over the short drop; Ray's defaults, 5 x (10 + 3) s, take up to 65 s)
RAY_HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "7",
}
SHORT_S = 10  # a Wi-Fi drop that must not cost a worker
LONG_S = 40  # longer than every timeout that applies: the collective's and grace (28 s), Ray's node health checks


def _records(run_dir: Path, kind: str) -> list[dict]:
    return run_records(run_dir, kind) if (run_dir / "metrics.jsonl").exists() else []  # none before it starts


def _wait_until(what: str, check, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll `check()` until true; return the time it became true. Fails at once if the driver exited."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"the driver exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.1)
    return time.time()


def _raylets(temp_dir: str) -> list[psutil.Process]:
    """The running raylets of the Ray node whose --temp-dir is `temp_dir`."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        info = proc.info
        if info["name"] == "raylet" and info["status"] != psutil.STATUS_ZOMBIE:
            if any(temp_dir + "/" in part for part in info["cmdline"] or []):
                found.append(proc)
    return found


def _link(net: netns.Network, index: int, state: str) -> None:
    """Pull (down) or plug (up) host `index`'s cable: its end of the veth on the bridge."""
    subprocess.run(["ip", "link", "set", f"mt{net.tag}v{index}", state], check=True)


def test_a_partition_shorter_than_the_timeouts_costs_nothing_and_a_longer_one_costs_a_worker_that_comes_back(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", str(COLLECTIVE_TIMEOUT_S))
    monkeypatch.setenv("MIXTRAIN_LOST_GRACE_S", str(LOST_GRACE_S))
    tag = str(os.getpid() % 10000 + 1)
    homes = {name: tmp_path / name for name in ("head", "other")}
    mixtrain = os.path.join(BIN, "mixtrain")
    out, marker, driver_log = tmp_path / "train", str(tmp_path / "partitioned"), tmp_path / "driver.log"
    out.mkdir()
    run_dir = out / "run"

    def join(host: netns.Host) -> subprocess.CompletedProcess:
        argv = ["cluster", "join", f"{head.ip}:6379", "--token-file", str(homes["head"] / "auth_token")]
        return _run(host, [mixtrain, *argv, "--num-cpus", "1", "--temp-dir", f"/tmp/mt{tag}b"], homes["other"])

    with netns.Network(tag, 2, subnet=78) as net:
        head, other = net.hosts
        driver = None
        try:
            argv = ["cluster", "up", "--interface", net.interface(0), "--num-cpus", "1", "--temp-dir", f"/tmp/mt{tag}a"]
            up = _run(head, [mixtrain, *argv], homes["head"], **RAY_HEALTH)
            assert up.returncode == 0, up.stderr + up.stdout
            joined = join(other)
            assert joined.returncode == 0, joined.stderr + joined.stdout

            script = "tests/multihost/train_partition.py"
            driver = subprocess.Popen(
                head.cmd(sys.executable, script, f"{head.ip}:6379", str(out), marker),
                env=_env(homes["head"]),
                cwd=Path(__file__).resolve().parents[2],
                stdout=driver_log.open("w"),
                stderr=subprocess.STDOUT,
            )
            # 1. a short drop, once both workers are training: no failure, both go on
            _wait_until("first round", lambda: _records(run_dir, "round"), driver, 180)
            _link(net, 1, "down")
            time.sleep(SHORT_S)
            _link(net, 1, "up")
            rounds_before = len(_records(run_dir, "round"))
            two_more = lambda: len(_records(run_dir, "round")) >= rounds_before + 2  # noqa: E731
            _wait_until("2 rounds after the short drop", two_more, driver, 60)
            assert not _records(run_dir, "failure"), "a 10 s drop cost a worker"
            assert all(len(r["shares"]) == 2 for r in _records(run_dir, "round"))

            # 2. a long one: the other host's worker is lost within the timeouts, the head's goes on
            Path(marker).touch()  # from now on a group of one waits for a replacement before each step
            down_at = time.time()
            _link(net, 1, "down")
            lost_at = _wait_until("a failure record", lambda: _records(run_dir, "failure"), driver, LONG_S)
            time.sleep(max(0.0, down_at + LONG_S - time.time()))
            _link(net, 1, "up")
            assert lost_at - down_at <= COLLECTIVE_TIMEOUT_S + LOST_GRACE_S + 20, lost_at - down_at

            # 3. the host comes back: its Ray node was declared dead, and its raylet stops once it hears so;
            # `cluster join` again clears what is left of that node and joins; the run takes the new worker
            # back at a round boundary
            _wait_until("the other node's raylet to stop", lambda: not _raylets(f"/tmp/mt{tag}b"), driver, 60)
            rejoined = join(other)
            assert rejoined.returncode == 0, rejoined.stderr + rejoined.stdout
            # the dead node's record is dropped (its processes exited with the raylet, or a helper lingers)
            assert "stale record" in rejoined.stderr or "has no raylet any more" in rejoined.stderr, rejoined.stderr
            driver.wait(timeout=180)
            assert driver.returncode == 0, driver_log.read_text()[-4000:]
        finally:
            if driver is not None and driver.poll() is None:
                driver.kill()
            for host, name in ((other, "other"), (head, "head")):
                _run(host, [mixtrain, "cluster", "down"], homes[name])
            for side in "ab":  # Ray's logs stay with the test's folder, for a failure's post-mortem
                logs = Path(f"/tmp/mt{tag}{side}/session_latest/logs")
                if logs.is_dir():
                    shutil.copytree(logs, tmp_path / f"ray-{side}", dirs_exist_ok=True)
                shutil.rmtree(f"/tmp/mt{tag}{side}", ignore_errors=True)

    [failure] = _records(run_dir, "failure")
    assert [w["worker"]["host"] for w in failure["lost"]] == [other.ip], failure
    assert len(_records(run_dir, "rejoined")) == 1, driver_log.read_text()[-4000:]
    history = json.loads((out / "history.json").read_text())
    widths = [len(r["shares"]) for r in history]
    assert widths[0] == 2 and 1 in widths and widths[-1] == 2, widths
    steps = [(r["first_step"], r["num_steps"]) for r in history]
    assert sum(n for _, n in steps) == 60 and sorted(steps) == steps  # every step once, in order
    x, y = data("mlp", NUM_SAMPLES)
    assert_same_weights(torch.load(out / "weights.pt", weights_only=True), reference("mlp", "sgd", x, y))
