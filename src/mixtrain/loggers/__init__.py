"""Loggers: the run's parameters and metrics in the trackers people already use, each a mixtrain.Callback.

    from mixtrain.loggers import MLflowLogger, TensorBoardLogger, WandbLogger

    Trainer(..., callbacks=[MLflowLogger(experiment="digits"), WandbLogger(project="digits")])

`mixtrain train --logger mlflow --logger wandb` does the same from the command line. Each tracker is an optional
extra (pip install "mixtrain[mlflow]", "mixtrain[wandb]", "mixtrain[tensorboard]"): a logger whose library is
missing fails when it is made, before any worker starts. All three log the same names:

    train/loss, train/samples_per_s, train/grad_norm, train/lr/group<i>     each round
    samples_per_s/<device>, share/<device>                                   each round, per worker
    held_out/<metric>                                                        each evaluation

at the run's global step (MLflow, W&B) or, as TensorBoard always had it, at the training samples seen. A tracker
that fails (a full disk, an unreachable server) is reported once and training goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mixtrain import _lazy

_PUBLIC = {
    "MLflowLogger": "mixtrain.loggers._mlflow",
    "TensorBoardLogger": "mixtrain.loggers._tensorboard",
    "WandbLogger": "mixtrain.loggers._wandb",
}
__all__ = ["MLflowLogger", "TensorBoardLogger", "WandbLogger", "by_name"]

NAMES = {"mlflow": "MLflowLogger", "wandb": "WandbLogger", "tensorboard": "TensorBoardLogger"}
"""`mixtrain train --logger NAME`: the logger each name makes."""

if TYPE_CHECKING:
    from mixtrain.callbacks import Callback
    from mixtrain.loggers._mlflow import MLflowLogger
    from mixtrain.loggers._tensorboard import TensorBoardLogger
    from mixtrain.loggers._wandb import WandbLogger


def by_name(name: str) -> Callback:
    """The logger `--logger NAME` asks for, with its defaults (its library checked: MissingExtraError if absent)."""
    from mixtrain.errors import InputValueError

    if name not in NAMES:
        raise InputValueError(f"--logger {name!r}: choose one of {', '.join(NAMES)}")
    logger: Callback = __getattr__(NAMES[name])()
    return logger


def __getattr__(name: str) -> Any:
    return _lazy.load("mixtrain.loggers", _PUBLIC, globals(), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
