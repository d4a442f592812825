"""Which strategy fits the measured link: a pure function of compute time, exchange time and bytes."""

from __future__ import annotations

import math

from mixtrain.config import StrategyConfig

ALLREDUCE_MAX_RATIO = 0.5
"""All-reduce is suggested while one exchange costs at most this fraction of a step's compute (it keeps the
exact math, and its exchange partly overlaps backward)."""
LOCAL_SGD_TARGET = 0.10
"""local-sgd's H is chosen so communication is at most this fraction of compute (H a power of 2, 2..64)."""


def suggest(compute_s: float, exchange_s: float, exchange_bytes: int, current: StrategyConfig, workers: int) -> str:
    """One line: the measured figures and the strategy they call for, with the flags to get it.
    `exchange_s`/`exchange_bytes`: one exchange of the current strategy (gradients or deltas)."""
    if workers < 2:
        return "one worker: nothing to exchange, any strategy trains alike"
    if compute_s <= 0 or exchange_s <= 0:
        return f"{current.describe()} (no measurement to compare strategies with)"
    mb = exchange_bytes / 2**20
    ratio = exchange_s / compute_s
    figures = (
        f"{mb:,.1f} MB per exchange took {exchange_s * 1e3:,.1f} ms ({mb / exchange_s:,.0f} MB/s) against "
        f"{compute_s * 1e3:,.1f} ms of compute per step"
    )
    if ratio <= ALLREDUCE_MAX_RATIO:
        verdict = "allreduce suggested: communication costs little here"
        if current.name != "allreduce":
            verdict += " (--strategy allreduce)"
        return f"{figures}: {verdict}"
    h = min(64, max(2, 2 ** math.ceil(math.log2(ratio / LOCAL_SGD_TARGET))))
    verdict = f"local-sgd with H={h} suggested (--strategy local-sgd --local-steps {h})"
    if current.compress == "none":
        verdict += "; --compress bf16 halves the bytes"
    return f"{figures}: {verdict}"
