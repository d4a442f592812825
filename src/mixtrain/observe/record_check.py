"""Whether a metrics.jsonl record has what `mixtrain report` reads from it. A run folder may come from anywhere:
a line that is not a record of the kind it says (a bare number, a round without its workers, a string where a
number belongs) is skipped and counted, never a KeyError or TypeError halfway through a plot."""

from __future__ import annotations

import math
from typing import Any


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _has(record: dict[str, Any], check: Any, *names: str) -> bool:
    return all(check(record.get(n)) for n in names)


def _optional(record: dict[str, Any], check: Any, *names: str) -> bool:
    return all(record.get(n) is None or check(record[n]) for n in names)


def _worker(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and _has(entry, _num, "samples", "compute_s", "wait_s", "comm_s")
        and _optional(entry, lambda v: _num(v) and math.isfinite(v) and v >= 0, "memory_bytes")
        and _optional(entry, lambda v: isinstance(v, str), "worker")
    )


def _round(r: dict[str, Any]) -> bool:
    workers, shares = r.get("workers"), r.get("shares")
    return (
        _has(r, _num, "time", "wall_s", "samples", "samples_per_s", "loss")
        and _has(r, _int, "epoch")
        and _optional(r, _int, "step", "first_step", "num_steps")
        and ("first_step" in r) == ("num_steps" in r)
        and isinstance(workers, list)
        and all(_worker(w) for w in workers)
        and isinstance(shares, list)
        and len(shares) == len(workers)
        and all(_num(s) for s in shares)
        and _optional(r, lambda v: isinstance(v, list) and all(_num(x) for x in v), "lr")
    )


def _eval(r: dict[str, Any]) -> bool:
    return (
        _has(r, _num, "loss")
        and _has(r, _int, "epoch")
        and _optional(r, _int, "step", "global_step")
        and (_optional(r, _num, "accuracy"))
    )


def _named(entry: Any) -> bool:
    return isinstance(entry, dict) and _has(entry, lambda v: isinstance(v, str), "device_name", "host")


def _event(r: dict[str, Any]) -> bool:
    kind = r["kind"]
    if kind in ("left_out", "rejoined", "readmitted", "failure") and not _num(r.get("time")):
        return False
    if kind == "failure":
        lost = r.get("lost")
        return (
            _has(r, _int, "epoch", "failures")
            and "step" in r
            and isinstance(lost, list)
            and all(isinstance(x, dict) and _named(x.get("worker")) for x in lost)
        )
    if not _named(r.get("worker")):
        return False
    return "step" in r if kind == "rejoined" else isinstance(r.get("reason"), str)


_CHECKS = {
    "round": _round,
    "eval": _eval,
    **{k: _event for k in ("left_out", "rejoined", "readmitted", "failure", "leave_out_confirmed")},
}


def well_formed(record: Any) -> bool:
    """A JSON object with a string kind, holding what the report reads for that kind (other kinds: kept, unread)."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    check = _CHECKS.get(record["kind"])
    return check is None or bool(check(record))
