"""Live progress on the driver's terminal (workers never print)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressView:
    """An overall bar (samples, loss, samples/s, ETA) plus one line per epoch and a final summary."""

    def __init__(self, enabled: bool, total_samples: int) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar: Progress | None = None
        if enabled:
            self._bar = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples  loss {task.fields[loss]:.4f}  {task.fields[rate]:,.0f} samples/s"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._task = self._bar.add_task("train", total=total_samples, epoch=0, loss=float("nan"), rate=0.0)
            self._bar.start()

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, soft_wrap=True, markup=False, highlight=False)

    def round_done(self, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(
                self._task,
                advance=record["samples"],
                epoch=record["epoch"],
                loss=record["last_loss"],
                rate=record["samples_per_s"],
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
