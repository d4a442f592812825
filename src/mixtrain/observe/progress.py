"""Live progress on the driver's terminal: one row per device and an overall bar, and lines above it (mixtrain's,
and a loop's rank 0's own output)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mixtrain.policies.planner import Plan
from mixtrain.records.messages import LeftOut, ProbeResult, WorkerInfo
from mixtrain.records.rounds import device_samples_per_s, time_split


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} B"  # a small model's weights are not "0 MiB"


def device_table(record: dict[str, Any]) -> Table:
    """The round's per-device rows: device, share of the batch, samples/s, busy/waiting/communicating, memory."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in (
        ("worker", "right"),
        ("device", "left"),
        ("node", "left"),
        ("share", "right"),
        ("samples/s", "right"),
        ("busy", "right"),
        ("waiting", "right"),
        ("comm", "right"),
        ("memory", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]
    total = sum(record["shares"]) or 1
    for rank, (w, share) in enumerate(zip(record["workers"], record["shares"])):
        table.add_row(
            str(rank),
            f"{w.get('device', '?')}  {w.get('device_name', '')[:24]}",
            str(w.get("host", "")),
            f"{share} ({share / total:.0%})",
            f"{device_samples_per_s(record, w):,.0f}",
            *(f"{part:.0%}" for part in time_split(w)),
            format_bytes(w.get("memory_bytes")),
        )
    return table


LOG_WIDTH = 200
"""Columns when the output is not a terminal (a CI log, `| tee run.log`): wide enough that no table is cut."""


def _console() -> Console:
    console = Console(stderr=True)
    return console if console.is_terminal else Console(stderr=True, width=LOG_WIDTH)


class ProgressView:
    """Per-device rows refreshed every round, an overall bar (epoch, samples, loss, samples/s, ETA),
    and lines (plans, epochs, events) printed above them. Off: only `log` lines are dropped too."""

    def __init__(self, enabled: bool, total_samples: int, epochs: int = 1, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or _console()
        self.epochs = epochs
        self._last: dict[str, Any] | None = None
        self._live: Live | None = None
        if enabled:
            self._bar = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}/{task.fields[epochs]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples  loss {task.fields[loss]:.4f}  {task.fields[rate]:,.0f} samples/s  ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(
                "train", total=total_samples, epoch=0, epochs=epochs, loss=float("nan"), rate=0.0
            )
            self._live = Live(self._bar, console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def start_at(self, samples: int) -> None:
        """A resumed run: the bar starts where the checkpoint left off."""
        if self._live is not None:
            self._bar.update(self._task, completed=samples)

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, soft_wrap=True, markup=False, highlight=False)

    def output(self, lines: list[str]) -> None:
        """A worker's own output lines, as it printed them (above the live rows), also when progress is off."""
        for line in lines:
            self.console.print(line, soft_wrap=True, markup=False, highlight=False, emoji=False)

    def round_done(self, record: dict[str, Any]) -> None:
        self._last = record
        if self._live is None:
            return
        self._bar.update(
            self._task,
            advance=record["samples"],
            epoch=record["epoch"] + 1,
            loss=record["last_loss"],
            rate=record["samples_per_s"],
        )
        self._live.update(Group(device_table(record), self._bar))

    def close(self) -> None:
        if self._live is None:
            return
        self._live.stop()
        self._live = None
        if self._last is not None:  # the last rows stay on the terminal (and in captured logs)
            self.console.print("last round, per device:")
            self.console.print(device_table(self._last))


def probe_memory_line(workers: Sequence[WorkerInfo], probes: Sequence[ProbeResult]) -> str:
    """What each device held while the start-up probe timed its micro-batch (before any optimizer state)."""
    parts = [f"worker {i} {format_bytes(p.peak_bytes)} at micro-batch {p.batch}" for i, p in enumerate(probes)]
    return "memory at start (peak while measuring, no optimizer state yet): " + "; ".join(parts)


def state_memory_line(record: dict[str, Any]) -> str:
    """After a round: each worker's peak and what its replica holds (a sharded optimizer shows its slice)."""
    parts = []
    for i, w in enumerate(record["workers"]):
        held = ", ".join(f"{k} {format_bytes(v)}" for k, v in w.get("state_bytes", {}).items() if v)
        parts.append(f"worker {i} peak {format_bytes(w.get('memory_bytes'))} ({held})")
    return "memory per worker: " + "; ".join(parts)


def plan_line(plan: Plan, before: Sequence[int], title: str) -> str:
    """A re-plan in one line: the shares before and after, the prediction, and a worker it would leave out."""
    line = (
        f"{title}: shares {':'.join(map(str, before))} -> {':'.join(map(str, plan.shares))}, "
        f"predicted {plan.predicted_samples_per_s:,.0f} samples/s"
    )
    for rank, reason in plan.excluded.items():
        line += f"; note: worker {rank} slows this job down: {reason}"
    return line


def plan_table(plan: Plan, workers: Sequence[WorkerInfo], title: str, left_out: Sequence[LeftOut] = ()) -> str:
    """One row per worker (where, on what, its share, micro-batch x accumulation, measured compute
    speed, predicted samples/s, memory cap), the workers left out with the reason, and the prediction."""
    lines = [
        f"{title}:",
        "  worker  node             device                      prec  threads  share  micro x acc"
        "  compute/s  predicted/s  memory cap",
    ]
    for i, w in enumerate(workers):
        speed = plan.speeds[i] if plan.speeds else 0.0
        cap = plan.memory_caps[i] if plan.memory_caps else None
        lines.append(
            f"  {i:>6}  {w.host[:15]:<15}  {w.device_name[:26]:<26}  {w.precision:<4}  {w.threads:>7}"
            f"  {plan.shares[i]:>5}  {plan.micro_batches[i]:>5} x {plan.accumulation[i]:<3}  {speed:>9,.0f}"
            f"  {plan.shares[i] / plan.predicted_step_s if plan.predicted_step_s else 0:>11,.0f}"
            f"  {cap if cap else 'no limit':>10}"
        )
    for gone in left_out:
        lines.append(f"  left out: {gone.worker.short()}: {gone.reason}")
    compute = plan.predicted_step_s - (plan.comm_s if len(plan.shares) > 1 else 0.0)
    lines.append(
        f"  predicted: {plan.predicted_samples_per_s:,.0f} samples/s, {plan.predicted_step_s * 1e3:.1f} ms per step "
        f"({compute * 1e3:.1f} ms compute + {plan.predicted_step_s * 1e3 - compute * 1e3:.1f} ms communication)"
    )
    for rank, reason in plan.excluded.items():
        lines.append(f"  note: worker {rank} slows this job down: {reason}; consider running without it")
    return "\n".join(lines)
