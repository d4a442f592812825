"""Pure functions that turn speeds and limits into integer shares of a global batch.

The controller measures, this module decides, the workers carry it out. The global batch,
and so the training math, never changes; only its split does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mixtrain.errors import InputValueError


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Integers proportional to `weights` that sum to exactly `total` (Hamilton's method).

    Ties go to the lower index, so the result is deterministic on every process.
    """
    if total < 0:
        raise ValueError(f"total={total} must be >= 0")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights={list(weights)} must be non-negative with a positive sum")
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    floors = [int(x) for x in exact]
    missing = total - sum(floors)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in by_remainder[:missing]:
        floors[i] += 1
    return floors


def equal_shares(global_batch: int, num_workers: int) -> list[int]:
    """The global batch split as evenly as integers allow; earlier workers take the remainder."""
    return largest_remainder([1.0] * num_workers, global_batch)


def resolve_shares(shares: Sequence[int] | str | None, global_batch: int, num_workers: int) -> list[int]:
    """The starting shares: the user's fixed ones (checked against the global batch), or equal."""
    if global_batch < num_workers:
        raise InputValueError(
            f"global_batch={global_batch} is smaller than num_workers={num_workers}: every worker needs at least "
            f"one sample per step; raise global_batch to >= {num_workers} or use fewer workers"
        )
    if shares is None or isinstance(shares, str):
        return equal_shares(global_batch, num_workers)
    if sum(shares) != global_batch:
        raise InputValueError(
            f"ScalingConfig.shares={list(shares)} sum to {sum(shares)} but global_batch={global_batch}; "
            "make the shares add up to the global batch"
        )
    return list(shares)


def shares_for_step(shares: Sequence[int], step_size: int) -> list[int]:
    """Shares for a step of `step_size` samples: the plan itself, or scaled down for the last partial batch."""
    if step_size == sum(shares):
        return list(shares)
    return largest_remainder([float(s) for s in shares], step_size)


@dataclass(frozen=True)
class Plan:
    """How the global batch is split, and what that split is expected to do."""

    shares: list[int]
    """Samples per worker per step; sums to the global batch."""
    micro_batches: list[int]
    """Largest micro-batch per worker (its share, or its memory cap when the share is larger)."""
    accumulation: list[int]
    """Micro-batches per step per worker (gradient accumulation when > 1)."""
    predicted_step_s: float
    """Compute of the slowest worker plus the communication estimate."""
    predicted_samples_per_s: float
    speeds: list[float] = field(default_factory=list)
    """Measured compute speed per worker (samples/s) the plan was made from."""
    memory_caps: list[int | None] = field(default_factory=list)
    """Largest micro-batch that fits per worker (None: no limit known)."""
    comm_s: float = 0.0
    """Communication estimate per step."""
    excluded: dict[int, str] = field(default_factory=dict)
    """At most one worker the job would be faster without, with the reason."""
    speedup_without: float = 1.0
    """How many times faster the job is predicted to run without the `excluded` worker (1.0: none named)."""


def balanced_shares(samples_per_s: Sequence[float], global_batch: int) -> list[int]:
    """Shares proportional to measured speed, every worker keeping at least one sample."""
    num = len(samples_per_s)
    if global_batch < num:
        raise InputValueError(f"global_batch={global_batch} is smaller than the {num} workers")
    speeds = [max(s, 1e-9) for s in samples_per_s]
    # one sample each first, the rest by speed, so no worker drops to 0 and stops being measured
    rest = largest_remainder(speeds, global_batch - num)
    return [r + 1 for r in rest]


def micro_batches(shares: Sequence[int], memory_caps: Sequence[int | None] | None) -> list[int]:
    """Per worker, the largest micro-batch: its share, or its memory cap when the share is larger."""
    caps = list(memory_caps) if memory_caps is not None else [None] * len(shares)
    return [min(s, c) if c else s for s, c in zip(shares, caps)]


def step_seconds(shares: Sequence[int], samples_per_s: Sequence[float], comm_s: float) -> float:
    """Predicted step time: the slowest worker's compute, then communication (none for one worker)."""
    compute = max(s / max(v, 1e-9) for s, v in zip(shares, samples_per_s))
    return compute + (comm_s if len(shares) > 1 else 0.0)


def exclusion(
    samples_per_s: Sequence[float], global_batch: int, comm_s: float, step_s: float, min_gain: float
) -> tuple[int, str, float] | None:
    """The worker whose removal speeds the job up most, when by at least `min_gain` (0.2 = 20%), why, and how
    many times faster the job is predicted to run without it.

    Without it the others take the whole batch, balanced by speed; communication stays the same
    with two or more left and disappears with one. Ties go to the slower worker."""
    num = len(samples_per_s)
    if num < 2:
        return None
    best: tuple[float, int] | None = None
    for i in sorted(range(num), key=lambda j: (samples_per_s[j], j)):
        others = [v for j, v in enumerate(samples_per_s) if j != i]
        if global_batch < len(others) or sum(others) <= 0:
            continue
        without = step_seconds(balanced_shares(others, global_batch), others, comm_s)
        if without > 0 and step_s / without >= 1.0 + min_gain and (best is None or without < best[0]):
            best = (without, i)
    if best is None:
        return None
    without, i = best
    why = "communication costs more than it adds" if num == 2 else "it adds less than it costs"
    reason = (
        f"the job is {step_s / without:.1f}x faster without it ({without * 1e3:.1f} ms per step instead of "
        f"{step_s * 1e3:.1f} ms; it computes {samples_per_s[i]:,.0f} samples/s, the others "
        f"{sum(samples_per_s) - samples_per_s[i]:,.0f}, communication {comm_s * 1e3:.1f} ms): {why}"
    )
    return i, reason, step_s / without


def make_plan(
    samples_per_s: Sequence[float],
    global_batch: int,
    *,
    shares: Sequence[int] | None = None,
    memory_caps: Sequence[int | None] | None = None,
    comm_s: float = 0.0,
    min_gain: float | None = None,
) -> Plan:
    """Turn speeds (and optional fixed shares, memory caps, a communication estimate) into a Plan.

    With `min_gain` set, the plan also names the one worker (if any) whose removal would make
    the job at least that much faster.
    """
    speeds = list(samples_per_s)
    caps: list[int | None] = list(memory_caps) if memory_caps is not None else [None] * len(speeds)
    shares = list(shares) if shares is not None else balanced_shares(speeds, global_batch)
    micro = micro_batches(shares, caps)
    accumulation = [math.ceil(s / m) if m else 1 for s, m in zip(shares, micro)]
    step_s = step_seconds(shares, speeds, comm_s)
    excluded, speedup = {}, 1.0
    if min_gain is not None:
        found = exclusion(speeds, global_batch, comm_s, step_s, min_gain)
        if found is not None:
            excluded[found[0]], speedup = found[1], found[2]
    return Plan(
        shares,
        micro,
        accumulation,
        step_s,
        global_batch / step_s if step_s > 0 else 0.0,
        speeds,
        caps,
        comm_s,
        excluded,
        speedup,
    )


def needs_rebalance(step_compute_s: Sequence[float], threshold: float) -> bool:
    """Hysteresis: re-plan only when the slowest worker's compute exceeds the mean by more than `threshold`."""
    mean = sum(step_compute_s) / len(step_compute_s)
    return mean > 0 and (max(step_compute_s) - mean) / mean > threshold


def plan_record(plan: Plan) -> dict[str, Any]:
    """The plan as it goes into metrics.jsonl."""
    return {
        "shares": plan.shares,
        "micro_batches": plan.micro_batches,
        "accumulation": plan.accumulation,
        "speeds": plan.speeds,
        "memory_caps": plan.memory_caps,
        "comm_s": plan.comm_s,
        "predicted_step_s": plan.predicted_step_s,
        "predicted_samples_per_s": plan.predicted_samples_per_s,
        "excluded": plan.excluded,
    }
