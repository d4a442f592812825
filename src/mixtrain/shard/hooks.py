"""When the sliced strategy's collectives run: hooks on the model, its blocks and their parameters. A block's
weights are gathered before its forward and freed after it, gathered again when its backward starts, and its
gradients go to their owners when the last of them is ready; the root's weights stay for the whole step."""

from __future__ import annotations

from typing import Any

import torch

from mixtrain.shard.gather import WeightGather
from mixtrain.shard.reduce import GradReduce
from mixtrain.shard.units import Unit, tensors


def register_hooks(model: torch.nn.Module, units: list[Unit], gather: WeightGather, reduce: GradReduce) -> list[Any]:
    """The hooks on `model` (the root: units[0]) and on each block of `units[1:]`; returns their handles."""
    root = units[0]
    handles = [
        model.register_forward_pre_hook(lambda *_: gather.gather(root)),
        model.register_forward_hook(lambda *_: _after_model_forward(gather, root)),
    ]
    for unit in units[1:]:
        assert unit.module is not None
        handles.append(unit.module.register_forward_pre_hook(lambda *_, unit=unit: gather.before_forward(unit)))
        handles.append(unit.module.register_forward_hook(_after_forward(gather, unit)))
        for p in unit.params:
            handles.append(p.register_post_accumulate_grad_hook(_grad_ready(reduce, unit)))
    return handles


def _after_model_forward(gather: WeightGather, root: Unit) -> None:
    gather.recorded = True
    if not torch.is_grad_enabled():  # no backward follows (evaluation): the root's weights go now
        gather.release(root)


def _after_forward(gather: WeightGather, unit: Unit) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if unit.backward:  # a recomputation inside backward (activation checkpointing): keep the weights
            return
        gather.release(unit)
        if torch.is_grad_enabled():
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(_backward_starts(gather, unit))

    return hook


def _backward_starts(gather: WeightGather, unit: Unit) -> Any:
    def hook(grad: torch.Tensor) -> None:
        if not unit.backward:
            unit.backward = True
            unit.waiting = {id(p) for p in unit.params}
            gather.gather(unit)

    return hook


def _grad_ready(reduce: GradReduce, unit: Unit) -> Any:
    def hook(p: torch.Tensor) -> None:
        unit.waiting.discard(id(p))
        if unit.backward and not unit.waiting:
            reduce.reduce(unit)

    return hook
