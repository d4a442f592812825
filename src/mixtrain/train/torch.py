"""mixtrain.train.torch, named after ray.train.torch: TorchTrainer, prepare_model, prepare_data_loader."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mixtrain.train._api import get_device

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from mixtrain.train._prepare import PreparedLoader, PreparedModel
    from mixtrain.train._trainer import TorchTrainer

__all__ = ["TorchTrainer", "get_device", "prepare_data_loader", "prepare_model"]


def prepare_model(model: torch.nn.Module, **_ignored: Any) -> PreparedModel:
    """`model` on this worker's device, wrapped so that `loss.backward()` sums the gradients over the workers,
    each weighted by its share of the step's global batch: `.grad` afterwards is what one process training the
    whole batch would have, so the loop's own clipping and optimizers stay exact. `.module` is the model;
    `no_sync()` accumulates without exchanging, as DDP's. (Ray Train's keyword options are accepted and ignored.)"""
    from mixtrain.train import _session
    from mixtrain.train._prepare import PreparedModel

    return PreparedModel(model, _session.current("prepare_model"))


def prepare_data_loader(data_loader: DataLoader, move_to_device: bool = True, **_ignored: Any) -> PreparedLoader:
    """`data_loader`'s dataset, collate function, loader processes and pin_memory, with mixtrain's step-indexed
    sampler: each step's global batch (batch_size x the number of workers) split by the workers' shares, in
    RunConfig.seed's order (shuffle=True) or the dataset's (shuffle=False); batches arrive on this worker's
    device. `loader.sampler.set_epoch(epoch)` works as with DistributedSampler."""
    from mixtrain.train import _session
    from mixtrain.train._prepare import PreparedLoader

    return PreparedLoader(data_loader, _session.current("prepare_data_loader"), move_to_device)


def __getattr__(name: str) -> Any:
    if name == "TorchTrainer":
        from mixtrain.train._trainer import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module 'mixtrain.train.torch' has no attribute {name!r}")
