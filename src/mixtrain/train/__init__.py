"""Your own training loop on every device you own: `mixtrain.train` is named after `ray.train`, so a Ray Train
PyTorch script runs after replacing `ray.train` with `mixtrain.train`.

    import mixtrain.train
    from mixtrain.train import ScalingConfig
    from mixtrain.train.torch import TorchTrainer, prepare_data_loader, prepare_model

    def train_func(config):
        model = prepare_model(make_model())                 # gradients summed over the workers, by share
        loader = prepare_data_loader(DataLoader(data, batch_size=32, shuffle=True))
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        for epoch in range(config["epochs"]):
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad(); loss.backward(); optimizer.step()
            mixtrain.train.report({"loss": loss.item()})

    result = TorchTrainer(train_func, train_loop_config={"lr": 1e-3, "epochs": 5},
                          scaling_config=ScalingConfig(num_workers=2)).fit()

What mixtrain adds to such a loop: workers of different speeds get different shares of each global batch (the
loader's batch_size times the number of workers) and the math stays that of one process training the whole
batch; Apple GPUs beside NVIDIA ones and CPUs in one job; a lost worker restarts the loop on the rest from the
last reported checkpoint. `sum_over_workers({"correct": c, "count": n})` adds up what each worker counted on its
part of a prepared held-out loader, for a figure over the whole set. `import mixtrain.train` loads neither torch
nor Ray: each name resolves when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mixtrain import _lazy

_PUBLIC = {
    "ScalingConfig": "mixtrain.config",
    "RunConfig": "mixtrain.train.config",
    "FailureConfig": "mixtrain.train.config",
    "Checkpoint": "mixtrain.train.checkpoint",
    "Result": "mixtrain.train._result",
    "TrainingFailedError": "mixtrain.train._result",
    "report": "mixtrain.train._api",
    "get_context": "mixtrain.train._api",
    "get_checkpoint": "mixtrain.train._api",
    "get_device": "mixtrain.train._api",
    "sum_over_workers": "mixtrain.train._api",
}
__all__ = [
    "Checkpoint",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "get_device",
    "report",
    "sum_over_workers",
]

if TYPE_CHECKING:
    from mixtrain.config import ScalingConfig
    from mixtrain.train._api import get_checkpoint, get_context, get_device, report, sum_over_workers
    from mixtrain.train._result import Result, TrainingFailedError
    from mixtrain.train.checkpoint import Checkpoint
    from mixtrain.train.config import FailureConfig, RunConfig


def __getattr__(name: str) -> Any:
    if name == "torch":  # `import mixtrain.train` then mixtrain.train.torch.prepare_model(...), as with ray.train
        return importlib.import_module("mixtrain.train.torch")
    return _lazy.load("mixtrain.train", _PUBLIC, globals(), name)
