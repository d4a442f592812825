"""Pure summaries of a round: the record that goes into metrics.jsonl, and readings of it."""

from __future__ import annotations

from statistics import fmean

from mixtrain.core.messages import RoundPlan, WorkerReport


def worker_times(reports: list[WorkerReport]) -> list[dict[str, float | None]]:
    """Compute, wait and communication seconds per worker for a round.

    Waiting is not measured inside the all-reduce (that would cost another collective per
    step); it is derived: at each step a worker waits for the slowest one, so its wait is
    max_j compute_j - compute_i, and the rest of its collective time is communication.
    """
    num_steps = len(reports[0].compute_s)
    slowest = [max(r.compute_s[t] for r in reports) for t in range(num_steps)]
    out = []
    for r in reports:
        wait = sum(slowest[t] - r.compute_s[t] for t in range(num_steps))
        comm = max(0.0, sum(r.comm_s) + r.round_comm_s - wait)
        out.append(
            {
                "compute_s": sum(r.compute_s),
                "wait_s": wait,
                "comm_s": comm,
                "samples": r.samples,
                "sent_bytes": r.sent_bytes,
                "max_staleness": max(r.staleness, default=0),
                "memory_bytes": r.memory_bytes,
            }
        )
    return out


def summarize_round(plan: RoundPlan, reports: list[WorkerReport], wall_s: float) -> dict:
    """The record of one round as it goes into metrics.jsonl."""
    reports = sorted(reports, key=lambda r: r.rank)
    samples = sum(r.samples for r in reports)
    return {
        "epoch": plan.epoch,
        "first_step": plan.first_step,
        "num_steps": plan.num_steps,
        "samples": samples,
        "loss": fmean(reports[0].losses),
        "last_loss": reports[0].losses[-1],
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "skipped_steps": reports[0].skipped_steps,
        "nonfinite_steps": [r.nonfinite_steps for r in reports],
        "drift": max(r.drift for r in reports),
        "rebroadcast": reports[0].rebroadcast,
        "shares": list(plan.shares),
        "grad_norm": _mean_norm(reports),
        "workers": worker_times(reports),
    }


def _mean_norm(reports: list[WorkerReport]) -> float | None:
    """The mean gradient norm before clipping over the round's steps and workers (None: no clipping)."""
    norms = [n for r in reports for n in r.grad_norms]
    return fmean(norms) if norms else None


def worker_name(entry: dict, rank: int) -> str:
    """A round record's name for one of its workers (records written before workers were named: the rank)."""
    return entry.get("worker", f"worker {rank}")


def device_samples_per_s(record: dict, entry: dict) -> float:
    """What one worker contributed to a round's speed: its samples over the round's wall time."""
    return entry["samples"] / record["wall_s"] if record["wall_s"] else 0.0


def time_split(entry: dict) -> tuple[float, float, float]:
    """A worker's round as fractions busy (compute), waiting for slower peers, and communicating."""
    spent = entry["compute_s"] + entry["wait_s"] + entry["comm_s"] or 1.0
    return entry["compute_s"] / spent, entry["wait_s"] / spent, entry["comm_s"] / spent


def next_round_steps(step_s: float, target_s: float, fixed: int | None, max_steps: int = 10_000) -> int:
    """Steps for the next round: the user's fixed number, or enough for about `target_s` seconds."""
    if fixed is not None:
        return fixed
    if step_s <= 0:
        return max_steps
    return max(1, min(max_steps, round(target_s / step_s)))
