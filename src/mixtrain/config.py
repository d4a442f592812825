"""User-facing configuration: keyword-only dataclasses that check themselves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Where the workers run and how the global batch is split between them."""

    num_workers: int = 2
    """Number of workers; each holds one replica of the model."""
    cpus_per_worker: float = 1.0
    """Ray CPU resource reserved per worker (fractions allowed, as in Ray Train)."""
    threads_per_worker: int | None = None
    """torch intra-op threads per worker; None means max(1, int(cpus_per_worker))."""
    shares: Sequence[int] | None = None
    """Fixed samples per worker per step, summing to the global batch; None splits equally."""
    placement_strategy: str = "PACK"
    """Ray placement group strategy for the workers' bundles."""
    address: str | None = None
    """Ray cluster to connect to ("auto", "ray://...", "host:port"); None starts an embedded local Ray."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"ScalingConfig.num_workers={self.num_workers!r}: must be an integer >= 1")
        if not self.cpus_per_worker > 0:
            raise ValueError(
                f"ScalingConfig.cpus_per_worker={self.cpus_per_worker!r}: must be > 0 "
                "(fractions such as 0.5 are allowed)"
            )
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"ScalingConfig.threads_per_worker={self.threads_per_worker!r}: must be >= 1 or None")
        if self.placement_strategy not in _PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ScalingConfig.placement_strategy={self.placement_strategy!r}: "
                f"use one of {', '.join(_PLACEMENT_STRATEGIES)}"
            )
        if self.shares is not None:
            shares = list(self.shares)
            if len(shares) != self.num_workers:
                raise ValueError(
                    f"ScalingConfig.shares={shares}: has {len(shares)} entries but num_workers={self.num_workers}; "
                    "give one share per worker"
                )
            if any(not isinstance(s, int) or s < 1 for s in shares):
                raise ValueError(f"ScalingConfig.shares={shares}: every share must be an integer >= 1")

    @property
    def num_threads(self) -> int:
        return self.threads_per_worker or max(1, int(self.cpus_per_worker))


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run writes its files and how its rounds are paced."""

    name: str | None = None
    """Run name; the run folder is storage_dir/name. None uses a timestamp."""
    storage_dir: str = "mixtrain_runs"
    """Folder that holds one sub-folder per run."""
    run_dir: str | None = None
    """Exact run folder; overrides storage_dir/name."""
    seed: int = 0
    """Seeds the model initialisation and the per-epoch sample permutation."""
    steps_per_round: int | None = None
    """Steps each worker runs per driver call; None sizes rounds to about 1.5 s (MIXTRAIN_ROUND_TARGET_S)."""
    drift_tolerance: float = 1e-6
    """Relative parameter-checksum difference above which rank 0's weights are re-broadcast."""
    progress: bool = True
    """Show live progress on the terminal."""

    def __post_init__(self) -> None:
        if self.steps_per_round is not None and self.steps_per_round < 1:
            raise ValueError(f"RunConfig.steps_per_round={self.steps_per_round!r}: must be >= 1 or None (automatic)")
        if not self.drift_tolerance >= 0:
            raise ValueError(f"RunConfig.drift_tolerance={self.drift_tolerance!r}: must be >= 0")
