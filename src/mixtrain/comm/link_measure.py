"""How long one exchange takes, measured at start-up for the planner and `--strategy auto`, in bounded time.

Timing the real exchange is the best measure where it is quick. Over a slow link with a large model it is not:
GPT-2's 500 MB all-reduce over a 50 Mbit/s Wi-Fi takes 80 s, past the collective timeout (60 s) gloo is given
for one collective, and a 100 MB model over 5 Mbit/s spent five minutes measuring. So the
measurement first times a probe of PROBE_BYTES through the same kind of collective; where the whole exchange
would take longer than MEASURE_BUDGET_S at that pace, it times a second, larger probe (about the budget) and
extrapolates the line through the two (a fixed cost per collective plus the bytes at the link's pace) to
the exchange's bytes, never calling the real one. Every rank makes the same calls: the decisions follow the
slowest rank's times, shared with a tiny all-reduce.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mixtrain.comm import replicas

MEASURE_BUDGET_S = 3.0
"""The start-up link measurement stops repeating once it has taken about this long (a big model on Wi-Fi)."""
PROBE_BYTES = 2**18
"""The first probe's size (256 KiB): 0.4 s at 5 Mbit/s, a few milliseconds on a LAN. The second is at least 8
times larger and takes about MEASURE_BUDGET_S: the line through two close sizes would be mostly noise."""

Probe = Callable[[int], Callable[[], object]]
"""`probe(nbytes)`: a call that moves about `nbytes` per rank through the exchange's kind of collective."""


def slowest(seconds: float, collective: bool) -> float:
    """The largest of every rank's `seconds` (`collective`: one tiny all-reduce; every rank must call it)."""
    if not (collective and dist.is_initialized()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=replicas.comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.cpu())


def _timed(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def median_seconds(exchange: Callable[[], object], repeats: int, collective: bool = False) -> float:
    """Median wall time of `exchange` over up to `repeats` calls after one warm-up call: fewer when one exchange
    is slow. `collective`: every rank must make as many calls, so the slowest rank's warm-up decides for all."""
    warm = slowest(_timed(exchange), collective)
    repeats = max(1, min(repeats, int(MEASURE_BUDGET_S / max(warm, 1e-9))))
    return statistics.median(_timed(exchange) for _ in range(repeats))


def exchange_seconds(exchange: Callable[[], object], probe: Probe, nbytes: int, repeats: int) -> float:
    """Seconds one `exchange` of `nbytes` per rank takes (a collective: every rank calls this alike). Timed
    itself (median_seconds) where a PROBE_BYTES probe says it takes at most MEASURE_BUDGET_S; otherwise
    extrapolated from two probes, so the measurement takes a few seconds whatever the link and the model."""
    small = min(nbytes, PROBE_BYTES)
    probe_small = probe(small)
    first = slowest(_timed(probe_small), True)  # (also the probe's warm-up)
    if small >= nbytes or first * nbytes / small <= MEASURE_BUDGET_S:
        return median_seconds(exchange, repeats, collective=True)
    again = max(1, min(3, int(MEASURE_BUDGET_S / 2 / max(first, 1e-9))))  # (every rank: the same `first`)
    t_small = slowest(statistics.median(_timed(probe_small) for _ in range(again)), True)
    big = int(min(nbytes, max(8 * small, small * MEASURE_BUDGET_S / max(t_small, 1e-9))))
    t_big = slowest(_timed(probe(big)), True)
    if big >= nbytes:
        return t_big
    per_byte = (t_big - t_small) / (big - small)
    if per_byte <= 0:  # (noise larger than the bytes' time: the pace of the larger probe alone)
        return t_big * nbytes / big
    return t_big + per_byte * (nbytes - big)


def all_reduce_probe(nbytes: int) -> Callable[[], object]:
    """A sum over `nbytes` of fp32 on the collective device: an all-reduce exchange's kind of traffic."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=replicas.comm_device())
    return lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM)


def all_gather_probe(nbytes: int) -> Callable[[], object]:
    """Every rank's `nbytes` to every rank: an all-gather exchange's (int8/int4 deltas) kind of traffic."""
    mine = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=replicas.comm_device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return lambda: dist.all_gather(everyone, mine)
