"""Loading that costs time per sample: a Dataset whose __getitem__ takes about 1 ms (decoding an image,
say), read by mixtrain's workers with loader processes against without, in one run.

Command lines:
    python benchmarks/loader.py                          # 2 workers, loader processes 0 and 2, 3 epochs
    python benchmarks/loader.py --loader-workers 0,1,2,4 --epochs 2

Each configuration is one Trainer.fit on an embedded local Ray; samples/s is the training samples over
the rounds' wall time (the start-up probe and evaluation are not counted). The model is small, so the
loading is what limits the speed: the ideal with loader processes is the compute speed alone.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import mixtrain
from mixtrain.data import Loader

SAMPLES = 2048
COST_S = 0.001


class SlowSamples(torch.utils.data.Dataset):
    """Features and a class per sample, with `cost_s` of work per read (a sleep: I/O or decoding)."""

    def __init__(self, n: int = SAMPLES, cost_s: float = COST_S) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = (self.x[:, 0] > 0).long()
        self.cost_s = cost_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.cost_s)
        return self.x[i], self.y[i]


def make_task() -> mixtrain.Task:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    return mixtrain.Task(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=nn.functional.cross_entropy
    )


def run(loader_workers: int, epochs: int, workers: int) -> dict[str, float]:
    trainer = mixtrain.Trainer(
        make_task,
        Loader(dataset=SlowSamples(), num_workers=loader_workers),
        global_batch=128,
        scaling=mixtrain.ScalingConfig(num_workers=workers),
        run=mixtrain.RunConfig(progress=False),
    )
    result = trainer.fit(epochs=epochs)
    rounds = result.history[1:]  # the first round is warm-up
    samples = sum(r["samples"] for r in rounds)
    return {"loader_workers": loader_workers, "samples_per_s": samples / sum(r["wall_s"] for r in rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader-workers", default="0,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results = [run(int(n), args.epochs, args.workers) for n in args.loader_workers.split(",")]
    base = results[0]["samples_per_s"]
    print(f"{'loader processes':>16}  {'samples/s':>10}  {'vs first':>8}")
    for r in results:
        print(f"{r['loader_workers']:>16}  {r['samples_per_s']:>10,.0f}  {r['samples_per_s'] / base:>7.2f}x")
    print(f"(a read costs {COST_S * 1e3:.0f} ms: one process alone reads at most {1 / COST_S:,.0f} samples/s)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
