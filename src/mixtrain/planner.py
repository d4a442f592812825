"""Pure functions that turn weights into integer shares of a global batch.

Fixed shares for now; speed-aware balancing plugs in here by producing the weights.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def resolve_shares(shares: Sequence[int] | None, global_batch: int, num_workers: int) -> list[int]:
    """Check user shares against the global batch, or split it equally when none are given."""
    if global_batch < num_workers:
        raise ValueError(
            f"global_batch={global_batch} is smaller than num_workers={num_workers}: every worker needs at least "
            f"one sample per step; raise global_batch to >= {num_workers} or use fewer workers"
        )
    if shares is None:
        return equal_shares(global_batch, num_workers)
    if sum(shares) != global_batch:
        raise ValueError(
            f"ScalingConfig.shares={list(shares)} sum to {sum(shares)} but global_batch={global_batch}; "
            "make the shares add up to the global batch"
        )
    return list(shares)


def shares_for_step(shares: Sequence[int], step_size: int) -> list[int]:
    """Shares for a step of `step_size` samples: the plan itself, or scaled down for the last partial batch."""
    if step_size == sum(shares):
        return list(shares)
    return largest_remainder([float(s) for s in shares], step_size)
