"""Run as a script (its own Ray, apart from the test session's): a `ray.cluster_utils.Cluster`
with declared resources (a CUDA box, a Mac as Ray 2.60 shows it, a CPU-only box) and real
placement groups and actors. Prints one JSON object with where each worker landed."""

from __future__ import annotations

import json
import sys
import time

import ray
from ray.cluster_utils import Cluster

from mixtrain import ScalingConfig
from mixtrain.config import parse_workers
from mixtrain.group.worker_calls import Pending
from mixtrain.group.worker_group import WorkerGroup


def landed(scaling: ScalingConfig, names: dict[str, str]) -> list[dict]:
    group = WorkerGroup(scaling, seed=0)
    try:
        group.start()
        infos = group.each(lambda w: w.info(), timeout_s=60)
        gpus = group.each(lambda w: Pending(w.actor.gpu_ids.remote(), "gpu_ids"), timeout_s=60)  # this test's own
        specs = [m.spec for m in group.members]
        return [{"device": s.device, "node": names[i.node_id], "gpus": g} for s, i, g in zip(specs, infos, gpus)]
    finally:
        group.shutdown()


class PlacementWorker(WorkerGroup.worker_cls):  # type: ignore[misc,name-defined]
    def gpu_ids(self) -> list:
        return ray.get_gpu_ids()


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    nodes = {
        "cuda-box": cluster.add_node(num_cpus=2, num_gpus=1, resources={"cuda": 1, "accelerator_type:A100": 1}),
        "mac": cluster.add_node(num_cpus=2, num_gpus=1, resources={"accelerator_type:M2": 1}),
        "cpu-box": cluster.add_node(num_cpus=2),
    }
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    names = {n.node_id: name for name, n in nodes.items()}
    names[cluster.head_node.node_id] = "head"
    WorkerGroup.worker_cls = PlacementWorker
    out: dict = {
        "explicit": landed(ScalingConfig(groups=parse_workers("mps:1,cuda:1,cpu:2")), names),
        "auto": landed(ScalingConfig(groups="auto"), names),
    }
    t0 = time.monotonic()
    try:
        landed(ScalingConfig(groups=parse_workers("cuda:2")), names)
        out["impossible"] = "no error"
    except RuntimeError as exc:
        out["impossible"] = str(exc)
    out["impossible_s"] = time.monotonic() - t0
    ray.shutdown()
    cluster.shutdown()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
