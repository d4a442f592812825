"""A torchrun DDP script on scikit-learn's handwritten digits, moved to mixtrain. The lines that change are marked
`was:`; the launcher is the other one:

    torchrun --nproc_per_node=2 docs/examples/torchrun_digits.py --epochs 8     # was
    mixtrain run docs/examples/torchrun_digits.py --workers 2 -- --epochs 8     # now: CPUs, CUDA and Apple GPUs
    mixtrain run docs/examples/torchrun_digits.py --workers cuda:1,mps:1 -- --epochs 8

Everything else stays: the script's init_process_group/destroy_process_group find mixtrain's group formed and
leave it be, RANK/WORLD_SIZE/LOCAL_RANK are set as torchrun sets them, and rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixtrain.train
from mixtrain.examples.digits import load_digits
from mixtrain.train.torch import prepare_data_loader, prepare_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="torchrun_digits.json")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    device = mixtrain.train.get_device()  # was: torch.device("cuda", int(os.environ["LOCAL_RANK"]))

    (x, y), (x_test, y_test) = load_digits()
    train = TensorDataset(x.reshape(len(x), 64), y)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = prepare_model(model)  # was: DistributedDataParallel(model.to(device), device_ids=[device])
    loader = prepare_data_loader(DataLoader(train, batch_size=16, shuffle=True))
    # was: DataLoader(train, batch_size=16, sampler=DistributedSampler(train))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    if rank == 0:
        with torch.no_grad():
            predicted = model(x_test.reshape(len(x_test), 64).to(device)).argmax(1).cpu()
        accuracy = float((predicted == y_test).float().mean())
        with open(args.out, "w") as f:
            json.dump({"accuracy": accuracy, "world_size": dist.get_world_size()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
