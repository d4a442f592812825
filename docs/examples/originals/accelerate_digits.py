"""The Hugging Face accelerate script docs/examples/accelerate_digits.py was ported from (tests/e2e/test_loop_guides.py
diffs the two): an accelerate loop with gradient accumulation over two batches, on scikit-learn's handwritten digits.

    accelerate launch --num_processes 2 docs/examples/originals/accelerate_digits.py --epochs 6
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixtrain.examples.digits import load_digits


def train_func(config: dict) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=2)
    (x, y), (x_test, y_test) = load_digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    held_out = DataLoader(TensorDataset(x_test, y_test), batch_size=64)
    model, optimizer, loader, held_out = accelerator.prepare(model, optimizer, loader, held_out)
    for _ in range(config["epochs"]):
        for step, (xb, yb) in enumerate(loader):
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        correct, count = 0, 0
        with torch.no_grad():
            for xb, yb in held_out:
                predicted, target = accelerator.gather_for_metrics((model(xb).argmax(1), yb))
                correct += int((predicted == target).sum())
                count += len(target)
        accuracy = correct / count
        accelerator.print(f"held-out accuracy {accuracy:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    train_func({"epochs": args.epochs})
