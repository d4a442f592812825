"""mixtrain: train one PyTorch model across every device you own, with the math of one big batch.

`import mixtrain` loads neither torch nor Ray: each public name is imported from its module the first time it is
used (PEP 562), so `mixtrain --help`, a config check and a worker process pay only for what they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mixtrain import _lazy

__version__ = "0.1.0"

_PUBLIC = {
    "Callback": "mixtrain.callbacks",
    "EarlyStopping": "mixtrain.callbacks",
    "StopTraining": "mixtrain.callbacks",
    "DeviceGroup": "mixtrain.config",
    "RunConfig": "mixtrain.config",
    "ScalingConfig": "mixtrain.config",
    "StrategyConfig": "mixtrain.config",
    "PSConfig": "mixtrain.config",
    "LocalSGDConfig": "mixtrain.config",
    "InputError": "mixtrain.errors",
    "Job": "mixtrain.job",
    "Result": "mixtrain.result",
    "Task": "mixtrain.task",
    "Trainer": "mixtrain.trainer",
    "TrainingInterrupted": "mixtrain.driver.interrupt",
    "TrainingStopped": "mixtrain.driver.controller",
    "WeightsNotSaved": "mixtrain.checkpoint",
    "WorkerError": "mixtrain.group.worker_group",
    "load_weights": "mixtrain.checkpoint",
    "export_pretrained": "mixtrain.pretrained",
    "release_workers": "mixtrain.worker.warm_workers",
}
__all__ = [
    "Callback",
    "EarlyStopping",
    "StopTraining",
    "DeviceGroup",
    "InputError",
    "Job",
    "LocalSGDConfig",
    "PSConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "StrategyConfig",
    "Task",
    "Trainer",
    "TrainingInterrupted",
    "TrainingStopped",
    "WeightsNotSaved",
    "WorkerError",
    "load_weights",
    "export_pretrained",
    "release_workers",
]
assert sorted(__all__) == sorted(_PUBLIC)

if TYPE_CHECKING:  # what a type checker and an IDE see: the names, from where they live
    from mixtrain.callbacks import Callback, EarlyStopping, StopTraining
    from mixtrain.checkpoint import WeightsNotSaved, load_weights
    from mixtrain.config import DeviceGroup, LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig
    from mixtrain.driver.controller import TrainingStopped
    from mixtrain.driver.interrupt import TrainingInterrupted
    from mixtrain.errors import InputError
    from mixtrain.group.worker_group import WorkerError
    from mixtrain.job import Job
    from mixtrain.pretrained import export_pretrained
    from mixtrain.result import Result
    from mixtrain.task import Task
    from mixtrain.trainer import Trainer
    from mixtrain.worker.warm_workers import release_workers


def __getattr__(name: str) -> Any:
    return _lazy.load("mixtrain", _PUBLIC, globals(), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
