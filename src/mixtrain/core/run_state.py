"""What the controller knows of a run: its fixed settings, and per worker what changes as it goes."""

from __future__ import annotations

from dataclasses import dataclass

from mixtrain.config import Slowdown
from mixtrain.core.messages import WorkerInfo


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the run was asked to do; fixed for the run (what changes lives in the controller's Roster)."""

    run_id: str = ""
    seed: int | None = None
    """RunConfig.seed, recorded in each checkpoint (None: unknown)."""
    data_fingerprint: str = ""
    """The training data's fingerprint (trainer._data_fingerprint), recorded in each checkpoint."""
    num_samples: int
    global_batch: int
    steps_per_round: int | None
    steps_per_exchange: int = 1
    """local-sgd's H: rounds are whole multiples of it (a round boundary ends with an exchange), but for an
    epoch's last round."""
    min_round_steps: int = 1
    """The shortest round but an epoch's last (overlapped local SGD: several exchanges)."""
    drift_tolerance: float
    num_eval: int
    balanced: bool = False
    """Follow measured speed (shares='auto'); otherwise the shares stay fixed."""
    leave_out_slow: bool = False
    """Leave out a worker that measurably slows the job down (balanced shares only)."""
    rejoin: bool = True
    """Let a replacement start where a worker was lost and join between rounds."""
    checkpoint_every_s: float = 60.0
    max_failures: int = 3
    max_nonfinite_steps: int = 10


@dataclass
class Roster:
    """What the controller knows per worker, in rank order; renumbered like the group."""

    workers: list[WorkerInfo]
    shares: list[int]
    memory_caps: list[int | None]
    speeds: list[float] | None
    """Compute samples/s per worker: the probe's, then smoothed over measured rounds."""
    slowdown: Slowdown
    """EMULATION: rank -> (factor, first round)."""

    def forget(self, ranks: list[int]) -> None:
        """Drop workers that are gone; the rest are renumbered like the group."""
        for rank in sorted(ranks, reverse=True):
            for seq in (self.workers, self.speeds, self.memory_caps, self.shares):
                if seq:
                    del seq[rank]
            self.slowdown = {r - (r > rank): v for r, v in self.slowdown.items() if r != rank}


@dataclass(frozen=True)
class Parked:
    """What the roster knew of a worker left out mid-run, to restore if it is taken back."""

    info: WorkerInfo
    speed: float | None
    memory_cap: int | None
    slowdown: tuple[float, int] | None
