"""What a worker holds: no second copy of the training state per round (recovery needs none), counted
tensor by tensor inside the worker, and its peak resident memory beside it."""

import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from mixtrain import RunConfig, ScalingConfig, Task, Trainer
from mixtrain.group.worker_group import WorkerGroup
from mixtrain.worker.replica import TrainWorker
from tests.conftest import run_records

pytestmark = pytest.mark.usefixtures("ray_session")

WIDTH = 2048  # 256x2048 + 2048x2048 + 2048x10 weights: 4.7M parameters, 19 MB


def wide_task() -> Task:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Task(model=model, optimizer=optimizer, loss_fn=nn.functional.cross_entropy)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process, each storage counted once."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class CountingWorker(TrainWorker):
    """After each round, counts the tensors this worker keeps and writes the figure beside its log."""

    def run_round(self, plan):
        report = super().run_round(plan)
        gc.collect()
        assert self.log_file is not None
        with open(self.log_file.parent / f"census-{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"live": live_tensor_bytes(), **report.state_bytes}) + "\n")
        return report


class CountingGroup(WorkerGroup):
    worker_cls = CountingWorker


class CountingTrainer(Trainer):
    worker_group_cls = CountingGroup


def test_between_rounds_a_worker_holds_weights_gradients_and_optimizer_state_once(tmp_path):
    # After every round the tensors alive in a worker are its weights, its gradient buckets (which are the
    # gradients) and AdamW's two moments: 4x the weights, plus small ones (the data's 1 MB, statistics).
    # The copy of weights and optimizer state the rollback used to keep would add 3x the weights.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64 * 16, 256, generator=g), torch.randint(0, 10, (64 * 16,), generator=g)
    result = CountingTrainer(
        wide_task,
        (x, y),
        global_batch=64,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), steps_per_round=4, progress=False, checkpoint_every_s=1e9),
    ).fit(epochs=1)
    weights = result.history[-1]["workers"][0]["state_bytes"]["weights"]
    assert result.history[-1]["workers"][0]["state_bytes"]["optimizer"] == 2 * weights + 6 * 4  # + a step count each
    for rank in range(2):
        census = [json.loads(line) for line in (Path(result.run_dir) / "logs" / f"census-{rank}.jsonl").open()]
        assert len(census) == len(result.history)
        for entry in census:
            assert 4 * weights <= entry["live"] < 4.3 * weights, (rank, entry["live"] / weights)
    # Resident memory, for the record (noisier: allocator slack, transients of the optimizer and collectives).
    [preflight] = run_records(result.run_dir, "preflight")
    for rank, worker in enumerate(result.history[-1]["workers"]):
        grown = worker["memory_bytes"] - preflight["probes"][rank]["peak_bytes"]
        print(f"worker {rank}: peak resident memory grew {grown / weights:.1f} x the weights over the probe's")
