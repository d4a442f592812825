"""What the controller knows of a run that stays fixed for it (per worker facts: group/membership.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the run was asked to do; fixed for the run (what changes per worker lives in its Member)."""

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
    max_steps: int | None = None
    """Stop at this global step (RunConfig.max_steps); None: at the last epoch's end."""
    eval_every: int | None = None
    """Evaluate every this many global steps (RunConfig.eval_every); None: at each epoch's end."""
    keep_best: tuple[str, str] | None = None
    """(metric, mode): keep the checkpoint with the best held-out value (RunConfig.keep_best)."""
    plan_tables: bool = False
    """A re-plan prints its whole table (RunConfig.plan_tables); else one line."""
    memory_caps: tuple[int, ...] | None = None
    """Per starting rank, the bytes its DeviceGroup(memory=...) gives it; None where no group gives memory."""
