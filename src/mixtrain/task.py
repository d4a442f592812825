"""What a user's task factory returns: the replica each worker trains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True)
class Task:
    """Model, loss and optimizer for one replica; built on the worker by the user's factory.

    The factory is called once per worker, after seeding torch with RunConfig.seed; rank
    0's initial state is then broadcast, so every replica starts identical.
    """

    model: torch.nn.Module
    """The model; called as model(*inputs) for a sample tuple (inputs..., target)."""
    optimizer: torch.optim.Optimizer
    """Optimizer over the model's parameters; stepped once per global step."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """loss_fn(output, target) -> the MEAN loss over the batch (mixtrain weights it by sample count)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Optional LR scheduler, stepped after every applied optimizer step."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"Task.optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if not callable(self.loss_fn):
            raise TypeError("Task.loss_fn must be callable as loss_fn(output, target)")


def build_task(factory: Callable[[], Task]) -> Task:
    """Call the user's factory and check what it returned."""
    task = factory()
    if not isinstance(task, Task):
        raise TypeError(
            f"the task factory returned {type(task).__name__}; it must return mixtrain.Task(model=..., "
            "optimizer=..., loss_fn=...)"
        )
    return task
