"""mixtrain.train.torch, named after ray.train.torch: TorchTrainer, prepare_model, prepare_data_loader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mixtrain.train._api import get_device

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from mixtrain.train._prepare import PreparedLoader, PreparedModel
    from mixtrain.train._trainer import TorchTrainer

__all__ = [
    "TorchTrainer",
    "get_device",
    "load_trainable_state_dict",
    "prepare_data_loader",
    "prepare_model",
    "trainable_state_dict",
]


def prepare_model(
    model: torch.nn.Module,
    move_to_device: Any = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
    *,
    shard: str = "none",
    slices: list[float] | None = None,
    blocks: Sequence[str | type[torch.nn.Module]] = (),
) -> PreparedModel:
    """`model` on this worker's device, wrapped so that `loss.backward()` sums the gradients over the workers,
    each weighted by its share of the step's global batch: `.grad` afterwards is what one process training the
    whole batch would have, so the loop's own clipping and optimizers stay exact. `.module` is the model;
    `no_sync()` accumulates without exchanging, as DDP's. Ray Train's options are taken where they ask what mixtrain
    does anyway (move_to_device=True, parallel_strategy="ddp", DDP's bucketing options) and refused in one line
    otherwise.

    `shard="gradients"` or `"full"` slices the training state by owner, as ScalingConfig(shard=) does for a Task
    (`slices`: each worker's relative share of it, equal by default). Build the optimizer after this, on what it
    returns: after `backward()` only this worker's parameters have a `.grad` (the global one), so
    `optimizer.step()` steps and keeps state for this worker's slice; clip with `model.clip_grad_norm_(max_norm)`
    and save `model.full_state_dict()` and `model.full_optimizer_state_dict(optimizer)`, called on every worker
    (`rank0_only=True`: the whole on worker 0 alone, {} on the others).
    `blocks` (with `shard="full"`): the module classes or class names whose instances are gathered one at a time,
    e.g. (GPT2Block,), as Task.shard_blocks; found by themselves when not given."""
    from mixtrain.train import _session
    from mixtrain.train._prepare import PreparedModel
    from mixtrain.train._settings import check_prepare_model_options

    check_prepare_model_options(move_to_device, parallel_strategy, parallel_strategy_kwargs)
    return PreparedModel(model, _session.current("prepare_model"), shard, slices, blocks)


def prepare_data_loader(
    data_loader: DataLoader, add_dist_sampler: bool = True, move_to_device: bool = True, auto_transfer: bool = True
) -> PreparedLoader:
    """`data_loader`'s dataset, collate function, loader processes and pin_memory, with mixtrain's step-indexed
    sampler: each step's global batch (batch_size x the number of workers) split by the workers' shares, in
    RunConfig.seed's order (shuffle=True) or the dataset's (shuffle=False); batches arrive on this worker's
    device. `loader.sampler.set_epoch(epoch)` works as with DistributedSampler. Ray Train's add_dist_sampler=False
    is refused (every worker would read the whole set); auto_transfer changes no batch and is taken as given."""
    from mixtrain.train import _session
    from mixtrain.train._prepare import PreparedLoader
    from mixtrain.train._settings import check_prepare_loader_options

    check_prepare_loader_options(add_dist_sampler)
    return PreparedLoader(data_loader, _session.current("prepare_data_loader"), move_to_device)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """What a loop checkpoints of a model with a frozen base (a `peft` LoRA model): `model.state_dict()` without
    the frozen parameters, with a fingerprint of them (their names, shapes, dtypes and bytes). Save it as any state
    dict (`torch.save`); every parameter trains: the whole state_dict. Give it `model.module` (the prepared model's
    own model), as with DDP."""
    from mixtrain.frozen_base import trainable_state_dict as trainable

    return trainable(model)


def load_trainable_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load what trainable_state_dict saved into `model`, built with its base as at the start; a model built on
    another base (its fingerprint differs) is refused in one line naming the first tensor that differs."""
    from mixtrain.frozen_base import load_trainable_state_dict as load

    load(model, state)


def __getattr__(name: str) -> Any:
    if name == "TorchTrainer":
        from mixtrain.train._trainer import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module 'mixtrain.train.torch' has no attribute {name!r}")
