"""Live progress on the driver's terminal (workers never print): one row per device and an overall bar."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mixtrain.core.rounds import device_samples_per_s, time_split


def worker_label(info: dict[str, Any]) -> str:
    """A worker's name in records and plots: stable across renumbering (rank changes when others leave)."""
    return f"{info['device']} on {info.get('hostname') or info['host']} (pid {info['pid']})"


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


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


class ProgressView:
    """Per-device rows refreshed every round, an overall bar (epoch, samples, loss, samples/s, ETA),
    and lines (plans, epochs, events) printed above them. Off: only `log` lines are dropped too."""

    def __init__(self, enabled: bool, total_samples: int, epochs: int = 1, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
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
