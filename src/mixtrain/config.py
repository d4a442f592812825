"""User-facing configuration: keyword-only dataclasses that check themselves."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SLOWDOWN_ENV = "MIXTRAIN_EMULATE_SLOWDOWN"


Slowdown = dict[int, tuple[float, int]]
"""rank -> (factor, first round it applies to)."""


def parse_slowdown(text: str) -> Slowdown:
    """'1:3,2:1.5@4' -> {1: (3.0, 0), 2: (1.5, 4)}: worker 2 turns slow from round 4 on."""
    out: Slowdown = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, sep, rest = item.partition(":")
        factor, _, start = rest.partition("@")
        try:
            if not sep:
                raise ValueError
            out[int(rank)] = (float(factor), int(start or 0))
        except ValueError:
            raise ValueError(
                f"{SLOWDOWN_ENV} item {item!r}: use RANK:FACTOR[@ROUND][,...], e.g. 1:3 or 1:3@5"
            ) from None
    return out


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Where the workers run and how the global batch is split between them."""

    num_workers: int = 2
    """Number of workers; each holds one replica of the model."""
    cpus_per_worker: float = 1.0
    """Ray CPU resource reserved per worker (fractions allowed, as in Ray Train)."""
    threads_per_worker: int | None = None
    """torch intra-op threads per worker; None means max(1, int(cpus_per_worker))."""
    shares: Sequence[int] | str = "auto"
    """"auto": start equal, then follow measured speed; "equal": fixed equal split; or fixed samples per worker."""
    max_micro_batch: Sequence[int | None] | None = None
    """Per worker, the largest micro-batch that fits in memory; a larger share is split (gradient accumulation)."""
    emulate_slowdown: Mapping[int, float | tuple[float, int]] | None = None
    """EMULATION for tests and benchmarks: rank -> factor (or (factor, from_round)), that worker computes
    `factor` times slower. Also read from MIXTRAIN_EMULATE_SLOWDOWN=RANK:FACTOR[@ROUND][,...]. Off by default."""
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
        if isinstance(self.shares, str):
            if self.shares not in ("auto", "equal"):
                raise ValueError(
                    f"ScalingConfig.shares={self.shares!r}: use 'auto', 'equal' or a list of integers, one per worker"
                )
        else:
            shares = list(self.shares)
            if len(shares) != self.num_workers:
                raise ValueError(
                    f"ScalingConfig.shares={shares}: has {len(shares)} entries but num_workers={self.num_workers}; "
                    "give one share per worker"
                )
            if any(not isinstance(s, int) or s < 1 for s in shares):
                raise ValueError(f"ScalingConfig.shares={shares}: every share must be an integer >= 1")

        if self.max_micro_batch is not None and (
            len(self.max_micro_batch) != self.num_workers or any(c is not None and c < 1 for c in self.max_micro_batch)
        ):
            raise ValueError(
                f"ScalingConfig.max_micro_batch={list(self.max_micro_batch)}: give one value >= 1 (or None) per worker"
            )
        for rank, (factor, start) in self.slowdown().items():
            if not 0 <= rank < self.num_workers or not factor >= 1 or start < 0:
                raise ValueError(
                    f"emulated slowdown {rank}:{factor} (ScalingConfig.emulate_slowdown or MIXTRAIN_EMULATE_SLOWDOWN): "
                    f"use RANK:FACTOR with 0 <= RANK < {self.num_workers} and FACTOR >= 1, e.g. 1:3"
                )

    @property
    def num_threads(self) -> int:
        return self.threads_per_worker or max(1, int(self.cpus_per_worker))

    @property
    def balanced(self) -> bool:
        return self.shares == "auto"

    def slowdown(self) -> Slowdown:
        """The emulated slowdown per rank: the API value, else MIXTRAIN_EMULATE_SLOWDOWN."""
        if self.emulate_slowdown is not None:
            return {r: v if isinstance(v, tuple) else (float(v), 0) for r, v in self.emulate_slowdown.items()}
        return parse_slowdown(os.environ.get(SLOWDOWN_ENV, ""))


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
