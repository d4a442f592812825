"""Pure summaries of a round: the typed record the driver keeps (its dict goes into metrics.jsonl), and readings
of that dict (the report reads it back from the file)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from statistics import fmean
from typing import Any

from mixtrain.policies.planner import micro_batches
from mixtrain.records.messages import RoundPlan, WorkerInfo, WorkerReport
from mixtrain.records.run_state import RunSettings

RAMP_FIRST_S = 0.2
"""Length of the first measured round; each next one doubles, up to MIXTRAIN_ROUND_TARGET_S."""


@dataclass(kw_only=True)
class WorkerRound:
    """One worker's part of a round, as the driver records it."""

    compute_s: float
    wait_s: float
    """Waiting for slower peers inside the exchanges (derived: see worker_times)."""
    comm_s: float
    samples: int
    sent_bytes: int
    max_staleness: int
    cpu_share: float | None
    cpu_wait_s: float
    memory_bytes: int | None
    state_bytes: dict[str, int]
    worker: str = ""
    """Who, by a name that stays when ranks renumber (WorkerInfo.label), and where: set by the controller."""
    device: str = ""
    device_name: str = ""
    host: str = ""

    def name(self, info: WorkerInfo) -> None:
        self.worker, self.device, self.device_name = info.label(), info.device, info.device_name
        self.host = info.hostname or info.host

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        return out if self.worker else {k: v for k, v in out.items() if k not in _NAMES}


_NAMES = ("worker", "device", "device_name", "host")


@dataclass(kw_only=True)
class RoundRecord:
    """One round as the driver records it; `as_dict()` is its line in metrics.jsonl and its entry in
    Result.history."""

    epoch: int
    first_step: int
    num_steps: int
    samples: int
    loss: float
    last_loss: float
    samples_per_s: float
    wall_s: float
    skipped_steps: list[int]
    nonfinite_steps: list[list[int]]
    drift: float
    rebroadcast: bool
    shares: list[int]
    grad_norm: float | None
    workers: list[WorkerRound]
    lr: list[float] = field(default_factory=list)
    """Per optimizer param group, the learning rate after the round's last step (rank 0's; every replica's is the
    same): the rate the round ended with, which the next round's first step uses."""
    partial: bool = False
    """A lost peer cut the round short: these are the steps that stand."""
    superseded: bool = False
    """Trained again after a rewind to an earlier checkpoint: kept in the history, not counted twice."""

    @property
    def steps(self) -> range:
        return range(self.first_step, self.first_step + self.num_steps)

    def name_workers(self, infos: list[WorkerInfo | None]) -> None:
        """Who each worker's entry is (`infos` in the entries' order), for the report and progress rows."""
        for entry, info in zip(self.workers, infos):
            if info is not None:
                entry.name(info)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("partial", "superseded")}
        out["workers"] = [w.as_dict() for w in self.workers]
        if self.partial:
            out["partial"] = True
        if self.superseded:
            out["superseded"] = True
        return out


def worker_times(reports: list[WorkerReport]) -> list[WorkerRound]:
    """Compute, wait and communication seconds per worker for a round.

    Waiting is not measured inside the all-reduce (that would cost another collective per
    step); it is derived: at each step a worker waits for the slowest one, so its wait is
    max_j compute_j - compute_i, and the rest of its collective time is communication.
    """
    num_steps = max(len(r.compute_s) for r in reports)  # after a lost peer, survivors may differ by a step
    slowest = [max(r.compute_s[t] for r in reports if t < len(r.compute_s)) for t in range(num_steps)]
    out = []
    for r in reports:
        wait = sum(slowest[t] - c for t, c in enumerate(r.compute_s))
        out.append(
            WorkerRound(
                compute_s=sum(r.compute_s),
                wait_s=wait,
                comm_s=max(0.0, sum(r.comm_s) + r.round_comm_s - wait),
                samples=r.samples,
                sent_bytes=r.sent_bytes,
                max_staleness=max(r.staleness, default=0),
                cpu_share=r.cpu_share,
                cpu_wait_s=r.cpu_wait_s,
                memory_bytes=r.memory_bytes,
                state_bytes=r.state_bytes,
            )
        )
    return out


def summarize_round(
    plan: RoundPlan, reports: list[WorkerReport], wall_s: float, partial: tuple[int, int] | None = None
) -> RoundRecord:
    """The record of one round. `partial`: (steps, samples) that stand of a round a lost peer cut short;
    `reports` are then the survivors' (the same steps' global results)."""
    reports = sorted(reports, key=lambda r: r.rank)
    num_steps, samples = partial if partial is not None else (plan.num_steps, sum(r.samples for r in reports))
    lead = max(reports, key=lambda r: len(r.losses))  # every rank's global results agree; some may lag
    losses = lead.losses[:num_steps]
    last = plan.first_step + num_steps
    return RoundRecord(
        epoch=plan.epoch,
        first_step=plan.first_step,
        num_steps=num_steps,
        samples=samples,
        loss=fmean(losses),
        last_loss=losses[-1],
        samples_per_s=samples / wall_s if wall_s > 0 else 0.0,
        wall_s=wall_s,
        skipped_steps=[s for s in lead.skipped_steps if s < last],
        nonfinite_steps=[[s for s in r.nonfinite_steps if s < last] for r in reports],
        drift=max(r.drift for r in reports),
        rebroadcast=reports[0].rebroadcast,
        shares=list(plan.shares),
        grad_norm=_mean_norm(reports),
        workers=worker_times(reports),
        lr=next((list(r.lr) for r in reports if r.lr), []),
        partial=partial is not None,
    )


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


def plan_round(
    shares: list[int],
    memory_caps: list[int | None],
    settings: RunSettings,
    at: tuple[int, int],
    num_steps: int,
    index: int,
) -> RoundPlan:
    """The run's `index`th round: `num_steps` steps from `at` = (epoch, step), on the active workers' `shares`,
    each in micro-batches its memory allows (`memory_caps`)."""
    return RoundPlan(
        epoch=at[0],
        first_step=at[1],
        num_steps=num_steps,
        shares=tuple(shares),
        global_batch=settings.global_batch,
        drift_tolerance=settings.drift_tolerance,
        micro_batches=tuple(micro_batches(shares, memory_caps)),
        round_index=index,
    )


def epoch_line(history: list[RoundRecord], epoch: int, epochs: int) -> str:
    """The epoch's line on the terminal: its last loss and its speed over the rounds that stand."""
    rounds = [r for r in history if r.epoch == epoch and not r.superseded]
    line = f"epoch {epoch + 1}/{epochs}:"
    if rounds:  # none when a run resumed exactly at this epoch's end (a Ctrl-C after its last round)
        samples, wall = sum(r.samples for r in rounds), sum(r.wall_s for r in rounds)
        line += f" loss {rounds[-1].last_loss:.4f}  {samples / wall:,.0f} samples/s"
    return line


def round_samples(plan: RoundPlan, num_steps: int, num_samples: int) -> int:
    """Training samples in `num_steps` steps from the round's first (the epoch's last step may be short)."""
    first, batch = plan.first_step, plan.global_batch
    return sum(min(batch, num_samples - t * batch) for t in range(first, first + num_steps))


def round_steps(settings: RunSettings, target_s: float, rounds_done: int = 0, step_s: float = 0.0) -> int:
    """Steps the next round asks for, after `rounds_done` rounds whose last took `step_s` a step. A short first
    round measures the step time (local SGD: H steps, the shortest without an early exchange); then rounds start
    short and double up to `target_s`: the first decisions (shares, leaving a worker out, checking that call)
    come within a second or two instead of after several full rounds."""
    if not rounds_done:
        return whole_exchanges(
            settings.steps_per_round or max(2, settings.min_round_steps), settings.steps_per_exchange
        )
    return next_round_steps(
        step_s,
        min(target_s, RAMP_FIRST_S * 2 ** (rounds_done - 1)),
        settings.steps_per_round,
        per_exchange=settings.steps_per_exchange,
        min_steps=settings.min_round_steps,
    )


def next_round_steps(
    step_s: float,
    target_s: float,
    fixed: int | None,
    max_steps: int = 10_000,
    per_exchange: int = 1,
    min_steps: int = 1,
) -> int:
    """Steps for the next round: the user's fixed number, or enough for about `target_s` seconds (at least
    `min_steps`); either way a whole number of `per_exchange` steps (local SGD's H), so that no round
    boundary forces an early one."""
    if fixed is not None:
        steps = fixed
    elif step_s <= 0:
        steps = max_steps
    else:
        steps = max(1, min_steps, min(max_steps, round(target_s / step_s)))
    return whole_exchanges(steps, per_exchange)


def whole_exchanges(steps: int, per_exchange: int) -> int:
    """`steps` rounded up to a multiple of `per_exchange`."""
    return -(-steps // per_exchange) * per_exchange
