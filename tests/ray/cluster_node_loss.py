"""Run as a script (its own Ray, apart from the test session's): a `ray.cluster_utils.Cluster` of three
nodes with one worker on each (STRICT_SPREAD). Once the run has written its second checkpoint, the
third node is removed from the cluster (its raylet and the worker on it die). Prints one JSON object:
the failure records, the workers per round, and whether the weights match single-process training."""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from mixtrain import RunConfig, ScalingConfig, Trainer
from tests.models import data, factory
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    doomed = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    run_dir = Path(tempfile.mkdtemp()) / "run"

    def remove_when_checkpointed() -> None:
        while len(list((run_dir / "checkpoints").glob("step-*"))) < 2:
            time.sleep(0.02)
        cluster.remove_node(doomed)

    threading.Thread(target=remove_when_checkpointed, daemon=True).start()
    x, y = data("mlp", NUM_SAMPLES)
    result = Trainer(
        factory("mlp", "sgd"),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=3, placement_strategy="STRICT_SPREAD", leave_out_slow=False),
        run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=2, progress=False, checkpoint_every_s=0),
    ).fit(epochs=1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    try:
        assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))
        exact = "yes"
    except AssertionError as exc:
        exact = str(exc)
    print(
        json.dumps(
            {
                "failures": [r for r in records if r["kind"] == "failure"],
                "widths": [len(r["shares"]) for r in result.history],
                "exact": exact,
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
