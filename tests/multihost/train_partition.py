"""Driver for the partition test: run inside the head's namespace as
`python tests/multihost/train_partition.py HEAD:PORT OUT_DIR MARKER`. Trains the exactness workload (60
steps) with one worker per host (STRICT_SPREAD), slowly enough (8 ms a sample, 0.5 s a step in all) for
the test to cut the link between the hosts twice; once MARKER exists, a group of one worker waits up to
2 s per step for a replacement's build (at most 2 minutes in all), so the run is still going when the
other host comes back, and its rounds still end (a replacement started while the node was being declared
dead is started again at a round boundary). Writes the weights and the run's history."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from mixtrain import RunConfig, ScalingConfig, Trainer
from mixtrain.cluster.headnode import use_cluster_token
from tests.models import data, faulty_task
from tests.ray.test_exactness import GLOBAL_BATCH, SEED

NUM_SAMPLES = 64 * 59 + 20  # 60 steps


def main(address: str, out: Path, marker: str) -> None:
    use_cluster_token(address)
    x, y = data("mlp", NUM_SAMPLES)
    task = functools.partial(
        faulty_task,
        "mlp",
        "sgd",
        "none",
        -1,
        0,
        marker,
        replacement_for=2,
        sleep_per_sample_s=0.008,
        replacement_wait_s=2.0,
    )
    result = Trainer(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD", address=address, leave_out_slow=False),
        run=RunConfig(run_dir=str(out / "run"), seed=SEED, steps_per_round=2, progress=False, checkpoint_every_s=0),
    ).fit(epochs=1)
    torch.save(result.state_dict, out / "weights.pt")
    (out / "history.json").write_text(json.dumps(result.history))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
