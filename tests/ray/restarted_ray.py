"""Run as a script (its own Ray, apart from the test session's): workers started through WorkerGroup in one
embedded Ray, that Ray stopped, and workers started again in a new one, in the same process. WorkerGroup makes
Ray's actor class once per worker class (group/worker_group._actor_class); Ray must export it again to the new
cluster. Prints one JSON object: each start's workers' pids and ranks, and whether the class was made once."""

from __future__ import annotations

import json
import sys

from mixtrain import ScalingConfig
from mixtrain.cluster import connect
from mixtrain.group import worker_group
from mixtrain.group.worker_group import WorkerGroup


def start_and_ask() -> list[dict]:
    connect.ensure_ray(None, 2)
    group = WorkerGroup(ScalingConfig(num_workers=2), seed=0)
    try:
        group.start()
        return [{"rank": i.rank, "pid": i.pid} for i in group.each(lambda w: w.info(), timeout_s=120)]
    finally:
        group.shutdown()
        connect.stop_ray_uninterrupted()


def main() -> None:
    first = start_and_ask()
    second = start_and_ask()  # a new embedded Ray: a new cluster and job
    info = worker_group._actor_class.cache_info()
    json.dump({"first": first, "second": second, "classes_made": info.misses, "reused": info.hits}, sys.stdout)


if __name__ == "__main__":
    main()
