"""What a user's task factory returns: the replica each worker trains, and how one batch becomes a loss."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from mixtrain.errors import InputTypeError, InputValueError

Batch = Any
"""Whatever the collate function makes: a tuple (inputs..., target) for tensor data, or dicts (Hugging Face
models), lists, nested containers."""


@dataclass(kw_only=True)
class Task:
    """Model, loss and optimizer for one replica; built on the worker by the user's factory.

    The factory is called once per worker, after seeding torch with RunConfig.seed; rank
    0's initial state is then broadcast, so every replica starts identical. Give `loss_fn` for
    samples (inputs..., target), or `compute_loss` for any batch.
    """

    model: torch.nn.Module
    """The model; called as model(*inputs) for a sample tuple (inputs..., target) unless compute_loss is given."""
    optimizer: torch.optim.Optimizer
    """Optimizer over the model's parameters; stepped once per global step."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """loss_fn(output, target) -> the MEAN loss over the batch (mixtrain weights it by sample count)."""
    compute_loss: Callable[[torch.nn.Module, Batch], torch.Tensor] | None = None
    """compute_loss(model, batch) -> the MEAN loss over the batch, for any batch the collate function makes,
    already on the worker's device; e.g. `lambda m, b: m(**b).loss` for a Hugging Face model."""
    metrics: Callable[[torch.nn.Module, Batch], dict[str, tuple[float, float]]] | None = None
    """metrics(model, batch) -> {name: (sum, count)} for one held-out batch; mixtrain sums both over all
    workers and reports sum / count per name. Without it: held-out loss, and accuracy for class targets."""
    max_grad_norm: float | None = None
    """Clip the global L2 norm of the whole step's reduced gradient to this (the same on every replica and
    parameter-server shard; under local-sgd, each worker's own mean gradient)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Optional LR scheduler, stepped after every applied optimizer step."""
    activation_checkpointing: tuple[type[torch.nn.Module], ...] = ()
    """Module types whose activations are recomputed in backward instead of kept (torch.utils.checkpoint),
    e.g. (nn.TransformerEncoderLayer,): less memory for some more compute, the same gradients (dropout
    masks are replayed). Applied to the model when the Task is made; only in training with gradients."""

    shard_blocks: tuple[type[torch.nn.Module] | str, ...] = ()
    """With ScalingConfig(shard="full"): the module classes (or class names) whose instances are the blocks whose
    weights are gathered one block at a time, e.g. (GPT2Block,), as FSDP's auto-wrap by class. Empty: the class
    that repeats most heavily is found by itself (what the start-up log names)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise InputTypeError(f"Task.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"Task.optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        if self.loss_fn is None and self.compute_loss is None:
            raise InputTypeError("Task needs loss_fn(output, target) or compute_loss(model, batch): give one of them")
        for name in ("loss_fn", "compute_loss", "metrics"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise InputTypeError(f"Task.{name} must be callable")
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float))
            and math.isfinite(self.max_grad_norm)
            and self.max_grad_norm > 0
        ):
            raise InputValueError(
                f"Task.max_grad_norm={self.max_grad_norm!r}: must be a number > 0, or None for no clipping"
            )
        if self.activation_checkpointing:
            recompute_activations(self.model, tuple(self.activation_checkpointing))
        from mixtrain.shard.blocks import check_named  # (a floor up: the block rule is the engine's)

        check_named(self.model, self.shard_blocks, "Task.shard_blocks")

    def batch_problem(self, batch: Batch) -> str | None:
        """Why this task cannot take `batch` (one the data makes), or None. `loss_fn` takes samples (inputs...,
        target): a dict (a Hugging Face dataset's) would reach the model as its keys, and fail deep inside it."""
        if self.compute_loss is not None or (isinstance(batch, (tuple, list)) and len(batch) >= 2):
            return None
        if isinstance(batch, Mapping):
            what = f"dicts (keys {', '.join(repr(k) for k in batch)})"
        elif isinstance(batch, (tuple, list)):
            what = f"{type(batch).__name__}s of {len(batch)} field, with no target"
        else:
            what = f"a {type(batch).__name__}, not (inputs..., target) tuples"
        return (
            f"the samples are {what}, but the task gives loss_fn, which calls model(*inputs) on samples "
            "(inputs..., target). Give compute_loss instead, which gets the whole batch: e.g. "
            "Task(model=..., optimizer=..., compute_loss=lambda m, b: m(**b).loss) for a Hugging Face model"
        )

    def batch_loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss of `batch` under `model` (a replica, or a copy of it for the numerics check)."""
        if self.compute_loss is None:
            assert self.loss_fn is not None
            problem = self.batch_problem(batch)
            if problem is not None:  # bring-up checks the training data first; held-out data is checked here
                raise InputValueError(problem)
            *inputs, target = batch
            return self.loss_fn(model(*inputs), target)
        loss = self.compute_loss(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InputTypeError(
                f"Task.compute_loss returned {got}; it must return the MEAN loss over the batch as a scalar "
                "tensor (e.g. `return out.loss`, or `loss.mean()` for per-sample losses)"
            )
        return loss.reshape(())


_RECOMPUTED: dict[type, type] = {}


def _recomputed_class(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """A subclass of `cls` whose forward runs under torch.utils.checkpoint while training with gradients. A
    class, not a wrapper module: parameter names (checkpoints, state_dict keys) and isinstance stay the same,
    and a deep copy of the model stays independent."""
    if cls not in _RECOMPUTED:

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            inner = functools.partial(cls.forward, self)  # the original class's forward
            if self.training and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    return _RECOMPUTED[cls]


def recompute_activations(model: torch.nn.Module, types: tuple[type[torch.nn.Module], ...]) -> None:
    """Every submodule of `types` recomputes its activations in backward (Task.activation_checkpointing)."""
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if bad:
        raise InputTypeError(
            f"Task.activation_checkpointing={types!r}: give module classes, e.g. (nn.TransformerEncoderLayer,)"
        )
    found = [m for m in model.modules() if isinstance(m, types) and type(m) not in _RECOMPUTED.values()]
    if not found and not any(type(m) in _RECOMPUTED.values() for m in model.modules()):
        kinds = sorted({type(m).__name__ for m in model.modules()})
        raise InputValueError(
            f"Task.activation_checkpointing={[t.__name__ for t in types]}: the model has no such module; "
            f"its module types are {', '.join(kinds)}"
        )
    for module in found:
        module.__class__ = _recomputed_class(type(module))


def build_task(factory: Callable[[], Task]) -> Task:
    """Call the user's factory and check what it returned."""
    task = factory()
    if not isinstance(task, Task):
        raise InputTypeError(
            f"the task factory returned {type(task).__name__}; it must return mixtrain.Task(model=..., "
            "optimizer=..., loss_fn=...) or Task(model=..., optimizer=..., compute_loss=...)"
        )
    return task
