"""A torchrun DDP script on scikit-learn's handwritten digits, moved to mixtrain: the script it was ported from is
originals/torchrun_digits.py. Against it, 5 lines change, 2 are added and 2 are removed (each marked `was:`,
`added` or `removed:`; tests/e2e/test_loop_guides.py diffs the two), and the launcher is the other one:

    torchrun --nproc_per_node=2 docs/examples/originals/torchrun_digits.py --epochs 8    # was (NVIDIA GPUs)
    mixtrain run docs/examples/torchrun_digits.py --workers 2 -- --epochs 8              # now: CPUs, CUDA, Apple GPUs
    mixtrain run docs/examples/torchrun_digits.py --workers cuda:1,mps:1 -- --epochs 8

Everything else stays: init_process_group("nccl") and destroy_process_group() find mixtrain's group formed and
leave it be, RANK/WORLD_SIZE/LOCAL_RANK are set as torchrun sets them, each DataLoader keeps its DistributedSampler
(mixtrain's sampler takes its place and keeps its shuffle), and rank 0 writes the results.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
import mixtrain.train  # was: from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from mixtrain.examples.digits import load_digits
from mixtrain.train.torch import prepare_data_loader, prepare_model  # added


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="torchrun_digits.json")
    parser.add_argument("--save", default="torchrun_digits.pt")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # removed: torch.cuda.set_device(local_rank)
    device = mixtrain.train.get_device()  # was: torch.device("cuda", local_rank)

    (x, y), (x_test, y_test) = load_digits()
    train = TensorDataset(x.reshape(len(x), 64), y)
    test = TensorDataset(x_test.reshape(len(x_test), 64), y_test)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = prepare_model(model)  # was: DistributedDataParallel(model.to(device), device_ids=[local_rank])
    loader = DataLoader(train, batch_size=16, shuffle=False, sampler=DistributedSampler(train))
    held_out = DataLoader(test, batch_size=64, sampler=DistributedSampler(test, shuffle=False))
    loader, held_out = prepare_data_loader(loader), prepare_data_loader(held_out)  # added
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    correct, count = 0, 0
    with torch.no_grad():
        for xb, yb in held_out:
            xb, yb = xb.to(device), yb.to(device)
            correct += int((model(xb).argmax(1) == yb).sum())
            count += len(yb)
    totals = mixtrain.train.sum_over_workers({"correct": correct, "count": count})  # was: torch.tensor([correct, count]
    # removed: dist.all_reduce(totals)
    accuracy, seen = totals["correct"] / totals["count"], int(totals["count"])  # was: float(totals[0] / totals[1])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"accuracy": accuracy, "count": seen, "world_size": dist.get_world_size()}, f)
        torch.save(model.module.state_dict(), args.save)  # the model's own keys, without DDP's "module."
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
