"""Datasets as users write them (importable on Ray workers): dict samples, random augmentation in
__getitem__, a read counter across processes, and data built on each machine."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from mixtrain import Task


class DictSamples(Dataset):
    """{"x": features, "y": class} per sample: what a tokenizer-style pipeline hands a model."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Augmented(Dataset):
    """Random noise from all three streams (torch, numpy, random) on every read, as torchvision transforms
    do: a frozen copy would repeat the same views every epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, count_dir: str | None = None) -> None:
        self.x, self.y, self.count_dir = x, y, count_dir

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.count_dir is not None:  # one line per read, from whichever process reads it
            with open(Path(self.count_dir) / f"reads-{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        noise = torch.randn(self.x.shape[1]) * 0.1 + float(np.random.uniform(-0.05, 0.05)) + random.random() * 0.01
        return self.x[i] + noise, self.y[i]


def read_counts(count_dir: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for f in Path(count_dir).glob("reads-*.txt"):
        for line in f.read_text().split():
            counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def dict_task(opt: str = "adamw") -> Task:
    from tests.models import mlp, optimizer

    m = mlp()
    return Task(
        model=m,
        optimizer=optimizer(opt, m.parameters()),
        compute_loss=lambda model, b: nn.functional.cross_entropy(model(b["x"]), b["y"]),
        metrics=lambda model, b: {"hits": (float((model(b["x"]).argmax(-1) == b["y"]).sum()), float(len(b["y"])))},
    )


def clipped_task(opt: str, max_norm: float) -> Task:
    from tests.models import mlp, optimizer

    m = mlp()
    return Task(
        model=m, optimizer=optimizer(opt, m.parameters()), loss_fn=nn.functional.cross_entropy, max_grad_norm=max_norm
    )


def first_come_dataset(marker_dir: str, what: str) -> Dataset:
    """Built on each worker: the first worker to build it gets one dataset, every later one another (by
    length or by content), as when two machines hold different copies of "the same" files."""
    from tests.models import data

    try:
        fd = os.open(Path(marker_dir) / "first", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        first = True
    except FileExistsError:
        first = False
    x, y = data("mlp", 200)
    if not first and what == "length":
        x, y = x[:190], y[:190]
    if not first and what == "content":
        x = x + 1.0
    return DictSamples(x, y)
