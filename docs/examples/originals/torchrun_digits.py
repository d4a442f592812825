"""The torchrun DDP script docs/examples/torchrun_digits.py was ported from (tests/e2e/test_loop_guides.py diffs the
two): a script of the usual shape for NVIDIA GPUs (as PyTorch's own ddp-tutorial-series multigpu_torchrun.py), on
scikit-learn's handwritten digits:

    torchrun --nproc_per_node=2 docs/examples/originals/torchrun_digits.py --epochs 8
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from mixtrain.examples.digits import load_digits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", default="torchrun_digits.json")
    parser.add_argument("--save", default="torchrun_digits.pt")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    (x, y), (x_test, y_test) = load_digits()
    train = TensorDataset(x.reshape(len(x), 64), y)
    test = TensorDataset(x_test.reshape(len(x_test), 64), y_test)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DistributedDataParallel(model.to(device), device_ids=[local_rank])
    loader = DataLoader(train, batch_size=16, shuffle=False, sampler=DistributedSampler(train))
    held_out = DataLoader(test, batch_size=64, sampler=DistributedSampler(test, shuffle=False))
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
    totals = torch.tensor([correct, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    accuracy, seen = float(totals[0] / totals[1]), int(totals[1])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"accuracy": accuracy, "count": seen, "world_size": dist.get_world_size()}, f)
        torch.save(model.module.state_dict(), args.save)  # the model's own keys, without DDP's "module."
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
