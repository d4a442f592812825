"""A Hugging Face accelerate loop on scikit-learn's handwritten digits, moved to mixtrain. The lines marked `was:`
are accelerate's; the launcher `accelerate launch train.py` becomes `python train.py` (TorchTrainer starts the
workers) or, for a script whose __main__ is the loop itself, `mixtrain run train.py`.

    python docs/examples/accelerate_digits.py                   # 2 CPU workers on this machine
    python docs/examples/accelerate_digits.py --workers cuda:1,mps:1
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixtrain.train
from mixtrain.config import parse_workers
from mixtrain.examples.digits import load_digits
from mixtrain.train import ScalingConfig
from mixtrain.train.torch import TorchTrainer, prepare_data_loader, prepare_model


def train_func(config: dict) -> None:
    # was: accelerator = Accelerator(gradient_accumulation_steps=2)
    (x, y), (x_test, y_test) = load_digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model, loader = prepare_model(model), prepare_data_loader(loader)
    # was: model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(config["epochs"]):
        for step, (xb, yb) in enumerate(loader):
            last_of_two = step % 2 == 1 or step == len(loader) - 1
            with model.no_sync() if not last_of_two else _nothing():  # was: with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb) / 2
                loss.backward()  # was: accelerator.backward(loss)
            if last_of_two:
                optimizer.step()
                optimizer.zero_grad()
        with torch.no_grad():
            predicted = model(x_test.to(mixtrain.train.get_device())).argmax(1).cpu()
        accuracy = float((predicted == y_test).float().mean())
        mixtrain.train.report({"accuracy": accuracy})  # was: accelerator.gather / accelerator.print


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="2")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    workers = parse_workers(args.workers)
    scaling = ScalingConfig(num_workers=workers) if isinstance(workers, int) else ScalingConfig(groups=workers)
    result = TorchTrainer(train_func, train_loop_config={"epochs": args.epochs}, scaling_config=scaling).fit()
    print(f"held-out accuracy {result.metrics['accuracy']:.3f}")
