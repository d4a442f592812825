"""A loop that saves a checkpoint at every epoch's report and resumes through get_checkpoint(): stopped (Ctrl-C, a
machine gone), the same command goes on from the last epoch it reported, with the same weights, optimizer and
order of samples as if it had not stopped. On scikit-learn's handwritten digits (nothing to download).

    python docs/examples/checkpoint_digits.py --run-dir mixtrain_runs/digits --epochs 20     # Ctrl-C it midway
    python docs/examples/checkpoint_digits.py --run-dir mixtrain_runs/digits --epochs 20     # goes on from there
    python docs/examples/checkpoint_digits.py --run-dir mixtrain_runs/digits --address 192.168.1.10:6379

The prepared model is DDP's counterpart: its own state_dict() keys start with "module.", so the loop saves
`model.module.state_dict()` (as with DDP), which loads into the plain model, here at the end on the driver.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixtrain.train
from mixtrain.examples.digits import load_digits
from mixtrain.train import Checkpoint, RunConfig, ScalingConfig
from mixtrain.train.torch import TorchTrainer, prepare_data_loader, prepare_model


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def train_func(config: dict) -> None:
    (x, y), (x_test, y_test) = load_digits()
    model = prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = prepare_data_loader(DataLoader(TensorDataset(x.reshape(-1, 64), y), batch_size=16, shuffle=True))
    held_out = prepare_data_loader(DataLoader(TensorDataset(x_test.reshape(-1, 64), y_test), batch_size=64))

    start = 0
    checkpoint = mixtrain.train.get_checkpoint()  # None on a fresh start
    if checkpoint is not None:  # a resumed run, or the loop restarted after a lost worker
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1

    for epoch in range(start, config["epochs"]):
        loader.sampler.set_epoch(epoch)  # each epoch's own order, also after a resume
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        correct, count = 0, 0
        with torch.no_grad():
            for xb, yb in held_out:  # each worker its part of the held-out set
                correct += int((model(xb).argmax(1) == yb).sum())
                count += len(yb)
        sums = mixtrain.train.sum_over_workers({"correct": correct, "count": count})  # the whole set's

        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if mixtrain.train.get_context().get_world_rank() == 0:  # one copy is enough: the replicas are equal
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
                torch.save(state, Path(folder) / "state.pt")
                saved = Checkpoint.from_directory(folder)
            # every worker reports; the checkpoint is in the run folder before report() returns
            mixtrain.train.report({"epoch": epoch, "accuracy": sums["correct"] / sums["count"]}, checkpoint=saved)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", default="mixtrain_runs/checkpoint-digits")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--address", default=None, help="a running Ray cluster's address (default: start one)")
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": args.epochs},
        scaling_config=ScalingConfig(num_workers=args.workers, address=args.address),
        run_config=RunConfig(name=run_dir.name, storage_path=str(run_dir.parent)),  # a folder with checkpoints: resumed
    )
    try:
        result = trainer.fit()
    except KeyboardInterrupt:  # Ctrl-C: every worker stopped at its next report, the checkpoints are kept
        sys.exit(f"stopped; the same command goes on from the last checkpoint in {run_dir}")

    model = make_model()  # the plain model: the saved keys are its own
    with result.checkpoint.as_directory() as folder:
        model.load_state_dict(torch.load(Path(folder) / "state.pt")["model"])
    (_, _), (x_test, y_test) = load_digits()
    with torch.no_grad():
        accuracy = float((model(x_test.reshape(-1, 64)).argmax(1) == y_test).float().mean())
    print(f"epochs {result.metrics_history[0]['epoch']}-{result.metrics['epoch']} in this run; "
          f"held-out accuracy {accuracy:.3f} from the last checkpoint")


if __name__ == "__main__":
    main()
