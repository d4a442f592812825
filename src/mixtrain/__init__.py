"""mixtrain: train one PyTorch model across every device you own, with the math of one big batch."""

from mixtrain.checkpoint import WeightsNotSaved, load_weights
from mixtrain.config import DeviceGroup, RunConfig, ScalingConfig, StrategyConfig
from mixtrain.core.controller import TrainingStopped
from mixtrain.core.interrupt import TrainingInterrupted
from mixtrain.core.warm_workers import release_workers
from mixtrain.core.worker_group import WorkerError
from mixtrain.job import Job
from mixtrain.result import Result
from mixtrain.task import Task
from mixtrain.trainer import Trainer

__all__ = [
    "DeviceGroup",
    "Job",
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
    "release_workers",
]
__version__ = "0.1.0"
