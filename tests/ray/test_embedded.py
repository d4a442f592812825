"""The embedded Ray mixtrain starts on a laptop: only the processes a local run needs, and nothing of the run
(Ray's processes, the workers' store and collectives) listening anywhere but on loopback."""

from __future__ import annotations

import functools
import ipaddress
import os
import subprocess
import sys
import threading

import psutil
import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from tests.conftest import REPO, run_cluster_script
from tests.models import _wait_for, data, factory, paused_in_training


def test_the_embedded_ray_starts_without_the_api_server_and_the_monitors_and_runs_tasks():
    out = run_cluster_script("embedded_lean.py", timeout=120)
    # GCS, raylet and its agents; no autoscaler monitor, log monitor or API server (dashboard head), each of
    # which costs a second or more of CPU at start-up and some of it all through the run
    assert {"gcs_server", "raylet"} <= set(out["processes"]), out
    assert not {"monitor", "log_monitor", "dashboard"} & set(out["processes"]), out
    assert out["answer"] == 49
    assert out["restored"], out
    # no dashboard agent: the raylet runs a stand-in where Ray would start it (with the arguments Ray builds here:
    # ray[default] installed, not --minimal, found without importing Ray's dashboard packages in the driver); the
    # runtime-env agent runs; the stand-in is gone once Ray has stopped
    assert out["standins"] == 1 and out["agents"] == ["ray::RuntimeEnvAgent"], out
    assert not out["agent_minimal"] and not out["deps_imported"] and out["standins_left"] == [], out
    # ... and its raylet registered at once: the agent's metrics and HTTP ports "not served" (-1, written before
    # the raylet started), the runtime-env agent's real
    ports = out["ports"]
    assert ports["MetricsAgentPort"] == ports["MetricsExportPort"] == ports["DashboardAgentListenPort"] == -1, out
    assert ports["RuntimeEnvAgentPort"] > 0 and ports["NodeManagerPort"] > 0, out


def test_workers_start_in_a_second_embedded_ray_with_the_actor_class_made_once():
    # WorkerGroup makes Ray's actor class once per worker class (each ray.remote(cls) was exported again at its
    # first actor); a Ray stopped and started again in the same process (a notebook, a sweep) must still get it
    out = run_cluster_script("restarted_ray.py", timeout=180)
    for start in ("first", "second"):
        assert sorted(w["rank"] for w in out[start]) == [0, 1], out
    assert not {w["pid"] for w in out["first"]} & {w["pid"] for w in out["second"]}, out  # new worker processes
    assert out["classes_made"] == 1 and out["reused"] == 3, out  # 4 workers started, one class


def _listening() -> list[dict]:
    """Every TCP socket this process and its descendants (the test session's Ray: GCS, raylet, agents, workers)
    listen on."""
    out = []
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            conns, name = proc.net_connections(kind="tcp"), proc.name()
        except psutil.Error:  # a process that ended meanwhile
            continue
        out += [
            {"ip": c.laddr.ip.removeprefix("::ffff:"), "port": c.laddr.port, "pid": proc.pid, "process": name}
            for c in conns
            if c.status == psutil.CONN_LISTEN
        ]
    return out


@pytest.mark.usefixtures("ray_session")  # started as mixtrain starts its embedded Ray (connect.start_embedded)
def test_a_run_on_one_machine_listens_on_loopback_only_and_its_store_is_closed_once_the_group_has_formed(tmp_path):
    marker = str(tmp_path / "training")
    x, y = data("mlp", 256)
    trainer = Trainer(
        functools.partial(paused_in_training, factory("mlp", "sgd"), marker),
        (x, y),
        global_batch=64,
        scaling=ScalingConfig(num_workers=2, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), progress=False),
    )
    seen: list[dict] = []

    def look_while_training() -> None:
        _wait_for(marker)  # worker 0's first training step: the group has formed, every worker is in it
        seen.extend(_listening())
        open(marker + ".go", "w").close()

    looker = threading.Thread(target=look_while_training)
    looker.start()
    try:
        result = trainer.fit(epochs=1)
    finally:
        open(marker + ".go", "w").close()
        looker.join()
    off_loopback = [s for s in seen if not ipaddress.ip_address(s["ip"]).is_loopback]
    assert seen and not off_loopback, off_loopback
    # each worker: Ray's gRPC server and gloo's listener; rank 0 no more than the others (its store is closed)
    per_worker = [sorted(s["port"] for s in seen if s["pid"] == w["pid"]) for w in result.workers]
    assert len(per_worker) == 2 and len(per_worker[0]) == len(per_worker[1]) >= 2, (per_worker, seen)


CONNECT = """
import sys
import ray
from mixtrain.cluster import connect
connect.ensure_ray(sys.argv[1], 1)
print(ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote(), timeout=60))
"""


def test_another_process_connects_to_the_embedded_ray_at_its_loopback_address(ray_address):
    # `mixtrain train --address` to a Ray that listens on loopback only: Ray's driver would replace 127.0.0.1
    # with the machine's LAN address, where nothing answers, and wait for minutes
    assert ipaddress.ip_address(ray_address.rpartition(":")[0]).is_loopback
    proc = subprocess.run(
        [sys.executable, "-c", CONNECT, ray_address],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "127.0.0.1", proc.stderr[-2000:]
