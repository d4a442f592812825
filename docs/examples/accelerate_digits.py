"""A Hugging Face accelerate loop on scikit-learn's handwritten digits, moved to mixtrain: the script it was ported
from is originals/accelerate_digits.py. Against it, 9 lines change, 10 are added and 1 is removed (each marked `was:`,
`added` or `removed:`; tests/e2e/test_loop_guides.py diffs the two). The launcher `accelerate launch train.py`
becomes `python train.py`: TorchTrainer starts the workers.

    python docs/examples/accelerate_digits.py                   # 2 CPU workers on this machine
    python docs/examples/accelerate_digits.py --workers cuda:1,mps:1
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext  # added

import torch
import mixtrain.train  # was: from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixtrain.examples.digits import load_digits
from mixtrain.config import parse_workers  # added
from mixtrain.train import ScalingConfig  # added
from mixtrain.train.torch import TorchTrainer, prepare_data_loader, prepare_model  # added


def train_func(config: dict) -> None:
    # removed: accelerator = Accelerator(gradient_accumulation_steps=2)
    (x, y), (x_test, y_test) = load_digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    held_out = DataLoader(TensorDataset(x_test, y_test), batch_size=64)
    model, loader, held_out = prepare_model(model), prepare_data_loader(loader), prepare_data_loader(held_out)  # was: accelerator.prepare(
    for _ in range(config["epochs"]):
        for step, (xb, yb) in enumerate(loader):
            last_of_two = step % 2 == 1 or step == len(loader) - 1  # added
            with model.no_sync() if not last_of_two else nullcontext():  # was: with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb) / 2  # was: loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()  # was: accelerator.backward(loss)
            if last_of_two:  # added
                optimizer.step()
                optimizer.zero_grad()
        correct, count = 0, 0
        with torch.no_grad():
            for xb, yb in held_out:
                predicted, target = model(xb).argmax(1), yb  # was: accelerator.gather_for_metrics(
                correct += int((predicted == target).sum())
                count += len(target)
        sums = mixtrain.train.sum_over_workers({"correct": correct, "count": count})  # was: accuracy = correct / count
        mixtrain.train.report({"accuracy": sums["correct"] / sums["count"]})  # was: accelerator.print(


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="2")  # added
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    workers = parse_workers(args.workers)  # added
    scaling = ScalingConfig(num_workers=workers) if isinstance(workers, int) else ScalingConfig(groups=workers)  # added
    result = TorchTrainer(train_func, train_loop_config={"epochs": args.epochs}, scaling_config=scaling).fit()  # was: train_func(
    print(f"held-out accuracy {result.metrics['accuracy']:.3f}")  # added
