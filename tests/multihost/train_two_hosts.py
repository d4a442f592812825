"""Driver for the two-host test: run inside the head's namespace as
`python tests/multihost/train_two_hosts.py HEAD:PORT OUT_DIR`. Trains the exactness workload
with one worker per host (STRICT_SPREAD) and writes the weights and the workers' hosts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mixtrain import RunConfig, ScalingConfig, Trainer
from mixtrain.cluster.headnode import use_cluster_token
from tests.models import data, factory
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED


def main(address: str, out: Path) -> None:
    use_cluster_token(address)
    x, y = data("mlp", NUM_SAMPLES)
    result = Trainer(
        factory("mlp", "sgd"),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, shares=[40, 24], placement_strategy="STRICT_SPREAD", address=address),
        run=RunConfig(run_dir=str(out / "run"), seed=SEED, steps_per_round=10, progress=False),
    ).fit(epochs=1)
    torch.save(result.state_dict, out / "weights.pt")
    (out / "workers.json").write_text(json.dumps(result.workers))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
