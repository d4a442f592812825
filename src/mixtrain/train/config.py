"""The run settings of a loop run (mixtrain.train), named as Ray Train names them: RunConfig and FailureConfig.
The workers are mixtrain's own ScalingConfig (mixtrain.config), re-exported by mixtrain.train."""

from __future__ import annotations

from dataclasses import dataclass, field

from mixtrain import _checks as check
from mixtrain.config import MAX_SEED
from mixtrain.errors import InputValueError


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """How many lost workers a run survives: each restarts the loop on the workers that are left (and a
    replacement where one can start), from the last checkpoint it reported."""

    max_failures: int = 3
    """Restarts allowed within any hour (MIXTRAIN_FAILURE_WINDOW_S); 0: the first lost worker ends the run."""

    def __post_init__(self) -> None:
        check.integer("FailureConfig.max_failures", self.max_failures, 0)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a loop run writes its files, and the seed that orders its data."""

    name: str | None = None
    """The run's folder under storage_path; None: loop-TIMESTAMP-XXXX."""
    storage_path: str = "mixtrain_runs"
    """Folder that holds one sub-folder per run (Ray Train's storage_path)."""
    seed: int = 0
    """Orders the data as Trainer's RunConfig.seed does: epoch e's permutation of every prepared loader."""
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    keep_checkpoints: int = 3
    """Checkpoints kept in RUN_DIR/checkpoints (the newest)."""
    progress: bool = True
    """Print a line for each report on the terminal."""

    def __post_init__(self) -> None:
        check.text("RunConfig.name", self.name, none=True)
        if self.name is not None and ("/" in self.name or self.name in (".", "..")):
            raise InputValueError(f"RunConfig.name={self.name!r}: a name, not a path; use storage_path for a folder")
        check.text("RunConfig.storage_path", self.storage_path)
        check.integer("RunConfig.seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.failure_config, FailureConfig):
            raise InputValueError(f"RunConfig.failure_config={self.failure_config!r}: give a FailureConfig")
        check.integer("RunConfig.keep_checkpoints", self.keep_checkpoints, 1)
        check.boolean("RunConfig.progress", self.progress)
