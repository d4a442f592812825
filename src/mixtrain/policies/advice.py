"""Which strategy fits the measured link: a pure function of compute time, exchange time and bytes."""

from __future__ import annotations

import math

from mixtrain.config import OVERLAP_EXCHANGES_PER_ROUND, QUANTIZED, Compression, StrategyConfig

ALLREDUCE_MAX_RATIO = 0.5
"""All-reduce is suggested while one exchange costs at most this fraction of a step's compute (it keeps the
exact math, and its exchange partly overlaps backward)."""
LOCAL_SGD_TARGET = 0.10
"""local-sgd's H is chosen so communication is at most this fraction of compute (H a power of 2, 2..64). With
overlap an exchange runs behind the next H steps' compute: only a round's last one blocks (one in
OVERLAP_EXCHANGES_PER_ROUND or more), so H needs to cover the exchange time and a quarter of the 10% rule."""
MAX_LOCAL_STEPS = 64
"""Past this H, int8 (then int4) deltas are suggested instead of more local steps."""
WIRE_BYTES = {"none": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0 + 4 / 256, "int4": 0.5 + 4 / 256}
"""Bytes per value on the wire (int8/int4: one fp32 scale per 256 values)."""
QUANTIZE_MIN_BYTES = 256 * 1024
"""Smaller exchanges are not quantized: a LAN's latency, not its bandwidth, sets their time."""


def suggest(
    compute_s: float,
    exchange_s: float,
    exchange_bytes: int,
    current: StrategyConfig,
    workers: int,
    round_limit: int | None = None,
) -> str:
    """One line: the measured figures and the strategy they call for, with the flags to get it.
    `exchange_s`/`exchange_bytes`: one exchange of the current strategy (gradients or deltas). `round_limit`:
    as for `choose`."""
    if workers < 2:
        return "one worker: nothing to exchange, any strategy trains alike"
    if compute_s <= 0 or exchange_s <= 0:
        return f"{current.describe()} (no measurement to compare strategies with)"
    mb = exchange_bytes / 2**20
    figures = (
        f"{mb:,.1f} MB per exchange took {exchange_s * 1e3:,.1f} ms ({mb / exchange_s:,.0f} MB/s) against "
        f"{compute_s * 1e3:,.1f} ms of compute per step"
    )
    chosen = choose(compute_s, exchange_s, current, workers, exchange_bytes, round_limit)
    if chosen.name == "allreduce":
        verdict = "allreduce suggested: communication costs little here"
        if current.name != "allreduce":
            verdict += " (--strategy allreduce)"
        return f"{figures}: {verdict}"
    h, compress = chosen.local_sgd.local_steps, chosen.compress
    flags = f"--strategy local-sgd --local-steps {h} --overlap"
    if compress != current.compress:
        verdict = f"overlapped local-sgd with H={h} and {compress} deltas suggested ({flags} --compress {compress})"
    else:
        verdict = f"overlapped local-sgd with H={h} suggested ({flags})"
    if compress == "none":
        verdict += "; --compress bf16 halves the bytes"
    return f"{figures}: {verdict}"


def choose(
    compute_s: float,
    exchange_s: float,
    current: StrategyConfig,
    workers: int,
    exchange_bytes: int,
    round_limit: int | None = None,
) -> StrategyConfig:
    """The strategy the figures call for, as `current` changed: all-reduce (the exact math) while one exchange
    costs at most ALLREDUCE_MAX_RATIO of a step's compute; else local SGD with the H (and, past H=64 or where
    rounds are too short, the int8/int4 deltas, for exchanges of QUANTIZE_MIN_BYTES or more) that bring
    communication under LOCAL_SGD_TARGET, overlapped (the exchange runs while the next H steps compute). What
    `--strategy auto` adopts. `round_limit`: the most steps a round can hold (an epoch, or the steps between
    evaluations), each round's last exchange blocking."""
    if workers < 2 or compute_s <= 0 or exchange_s <= 0 or exchange_s / compute_s <= ALLREDUCE_MAX_RATIO:
        return current.as_allreduce()
    if exchange_bytes < QUANTIZE_MIN_BYTES:
        need = _overlap_need(compute_s, exchange_s)
        return current.as_local_sgd(_power_of_two(need))
    h, compress = _local_steps_and_wire(exchange_s / compute_s, current.compress, round_limit)
    return current.as_local_sgd(h, compress)


def overlap_local_steps(compute_s: float, exchange_s: float) -> int:
    """H for overlapped local SGD whose one exchange (on its own wire) takes `exchange_s` against `compute_s` of
    compute per step: what `choose` gives for that wire."""
    return _power_of_two(_overlap_need(compute_s, exchange_s))


def _overlap_need(compute_s: float, exchange_s: float) -> float:
    """Local steps per exchange that cover the exchange and keep its blocking share under LOCAL_SGD_TARGET."""
    ratio = exchange_s / compute_s
    return max(ratio, ratio / (LOCAL_SGD_TARGET * OVERLAP_EXCHANGES_PER_ROUND))


def _power_of_two(need: float) -> int:
    return min(MAX_LOCAL_STEPS, max(2, 2 ** math.ceil(math.log2(need))))


def _local_steps_and_wire(ratio: float, compress: Compression, round_limit: int | None) -> tuple[int, Compression]:
    """H (a power of 2, 2..MAX_LOCAL_STEPS) and the wire for an exchange taking `ratio` steps' compute at the
    `compress` wire: the first wire (that one, then the narrower quantized ones) whose H is at most the cap and
    whose round's blocking last exchange stays under LOCAL_SGD_TARGET of the round (OVERLAP_EXCHANGES_PER_ROUND
    exchanges, or `round_limit` steps, the fewer); else the narrowest. A wire taken only to shorten that wait
    keeps the H the wider one needed: fewer bytes, as many exchanges (each exchange has costs of its own the
    bytes do not show: at 100 Mbit/s int8 at its own H=16 ran 84 samples/s where fp32 at H=64 ran 86-89).
    (The chars benchmark's 105-step epochs cut rounds of four H=64 exchanges short: fp32 deltas at 100 Mbit/s
    waited 2.2 s an epoch against 14 s of compute.)"""
    h, floor = MAX_LOCAL_STEPS, 0
    wires = [compress, *(w for w in QUANTIZED if WIRE_BYTES[w] < WIRE_BYTES[compress])]
    for wire in wires:
        wire_ratio = ratio * WIRE_BYTES[wire] / WIRE_BYTES[compress]
        need = _overlap_need(1.0, wire_ratio)
        h = max(_power_of_two(need), floor)
        round_steps = h * OVERLAP_EXCHANGES_PER_ROUND
        if round_limit:
            round_steps = min(round_steps, round_limit)
        if need <= MAX_LOCAL_STEPS:
            if wire_ratio / round_steps <= LOCAL_SGD_TARGET:
                return h, wire
            floor = h  # hidden, but the round's wait too long: fewer bytes at this H
    return h, wire
