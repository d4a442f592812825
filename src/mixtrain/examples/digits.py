"""A small CNN on scikit-learn's handwritten digits (1,797 real 8x8 images, shipped with the package).

Command lines:
    mixtrain train digits --workers 2                 # any laptop, no GPU needed; held-out accuracy ~0.98
    mixtrain train digits --workers 3 --shares 30,20,14 --global-batch 64 --epochs 5
    mixtrain train digits --workers cuda:1,cpu:1 --precision auto   # a GPU and the CPU beside it
    python -m mixtrain.examples.digits                # the same job through the Python API
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from mixtrain.job import Job
from mixtrain.task import Task

DEFAULT_LR = 2e-3


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_task(lr: float = DEFAULT_LR) -> Task:
    model = DigitsCNN()
    return Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr), loss_fn=nn.functional.cross_entropy)


def load_digits(
    seed: int = 0, eval_fraction: float = 0.2
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, held-out) tensors: images scaled to [0, 1] as (N, 1, 8, 8) float32, labels int64."""
    from mixtrain.errors import require

    require("sklearn", "scikit-learn", "examples", "the digits example (scikit-learn's 1,797 handwritten digits)")
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    num_eval = int(len(y) * eval_fraction)
    held, train = order[:num_eval], order[num_eval:]
    return (x[train], y[train]), (x[held], y[held])


def example(lr: float = DEFAULT_LR, seed: int = 0) -> Job:
    train, held = load_digits(seed)
    return Job(functools.partial(make_task, lr), train, held, global_batch=64, epochs=10)


def main() -> None:
    from mixtrain import ScalingConfig

    job = example()
    result = job.trainer(scaling=ScalingConfig(num_workers=2)).fit(epochs=job.epochs)
    print(f"held-out accuracy {result.metrics['accuracy']:.4f}; files in {result.run_dir}")


if __name__ == "__main__":
    main()
