"""What TorchTrainer.fit returns, and the error it raises when the loop fails."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixtrain.train.checkpoint import Checkpoint


class TrainingFailedError(RuntimeError):
    """The loop raised on a worker (the message names the worker, its device and the traceback), or the run lost
    more workers than FailureConfig.max_failures allows."""


@dataclass
class Result:
    """Ray Train's Result: the last metrics rank 0 reported, the last checkpoint, the run folder."""

    metrics: dict[str, Any]
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None = None
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    """Every report of rank 0, in order (each with its index and, where one came with it, the checkpoint)."""
    workers: list[dict[str, Any]] = field(default_factory=list)
    """Who trained (the last attempt): node, device, precision per rank."""

    @property
    def run_dir(self) -> Path:
        """The run folder, as the Task door's Result.run_dir (both doors' Results have run_dir, path, metrics,
        workers)."""
        return Path(self.path)

    def __repr__(self) -> str:
        return (
            f"Result(metrics={self.metrics!r}, checkpoint={self.checkpoint!r}, path={self.path!r}, "
            f"error={self.error!r})"
        )
