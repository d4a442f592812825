"""The driver's end of the loop's reports: a small Ray actor on the driver's node that the workers hand their
reports to (rank 0's metrics, the checkpoint's files, written into the run folder before report() returns), and
that the driver reads from while the loops run. It also carries the driver's Ctrl-C to the next report."""

from __future__ import annotations

from typing import Any

from mixtrain.train._store import LoopCheckpoints


class ReportSink:
    def __init__(self, run_dir: str, keep: int, global_batches: list[int] | None = None) -> None:
        self.store = LoopCheckpoints(run_dir, keep)
        self.global_batches = list(global_batches or [])
        """The run's global batch of each prepared loader, fixed by the first attempt that prepared it (or by the
        checkpoint a run resumed from): every restart's loaders keep them, and each checkpoint records them."""
        self.reports: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.stop = False
        self.leave_out: dict[str, Any] | None = None
        """A worker the job is faster without (rank, reason): every worker stops at the next report that comes
        with a checkpoint, and the driver restarts the loop from it without that one."""
        self.stopped_for: dict[str, Any] | None = None
        """The worker named when a report first stopped the loop to leave it out (what the driver leaves out)."""
        self.output: list[str] = []
        """Rank 0's output lines not yet taken by the driver (shown on its terminal)."""
        self.last_checkpoint: str | None = None
        self._saved: set[tuple[int, int]] = set()
        self._numbers: dict[tuple[int, int], int] = {}
        self._taken = (0, 0)

    def report(self, rank: int, key: tuple[int, int], metrics: dict[str, Any], files: dict[str, bytes] | None) -> bool:
        """One worker's report `key` (its loop's attempt, the report's number in it); returns whether the run is to
        stop there. The reports are numbered through the run (a restarted loop counts on)."""
        key = (int(key[0]), int(key[1]))  # it may travel as a list
        path = None
        if files is not None and key not in self._saved:  # the first rank to send one for this report
            number = self._number(key)
            meta = {"report": number, "rank": rank, "metrics": metrics, "global_batches": self.global_batches}
            path = str(self.store.save(files, meta))
            self._saved.add(key)
            self.last_checkpoint = path
        if rank == 0:
            entry = {"report": self._number(key), **metrics, **({"checkpoint": path} if path else {})}
            self.reports.append(entry)
        elif path is not None:
            self.events.append(("checkpoint", {"report": self._number(key), "rank": rank, "path": path}))
        if (self.stopped_for or self.leave_out) is not None and key in self._saved:
            # every rank stops at this report for the worker named when the first did, whatever a later look says
            self.stopped_for = self.stopped_for or self.leave_out
            return True  # a checkpoint of this report is kept: the loop goes on from it, without that worker
        return self.stop

    def _number(self, key: tuple[int, int]) -> int:
        """The report's number in the run: reports of earlier attempts come first."""
        if key not in self._numbers:
            self._numbers[key] = len(self._numbers) + 1
        return self._numbers[key]

    def event(self, kind: str, record: dict[str, Any]) -> None:
        self.events.append((kind, record))
        if kind == "loader" and int(record["index"]) == len(self.global_batches):  # a loader the run had not had
            self.global_batches.append(int(record["global_batch"]))
        if kind == "plan" and "leave_out" in record:  # named, or withdrawn (None) by later measurements
            self.leave_out = record["leave_out"]

    def run_batches(self) -> list[int]:
        return list(self.global_batches)

    def leaving(self) -> dict[str, Any] | None:
        return self.stopped_for or self.leave_out

    def clear_leave_out(self) -> None:
        self.leave_out = self.stopped_for = None

    def output_lines(self, lines: list[str]) -> None:
        self.output.extend(lines)

    def take(self) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]], list[str]]:
        """The reports, events and rank 0's output lines since the last take."""
        reports, events = self._taken
        self._taken = (len(self.reports), len(self.events))
        output, self.output = self.output, []
        return self.reports[reports:], self.events[events:], output

    def request_stop(self) -> None:
        self.stop = True

    def latest(self) -> tuple[str, dict[str, bytes]] | None:
        found = self.store.latest()
        return (str(found[0]), found[1]) if found is not None else None

    def checkpoint_path(self) -> str | None:
        return self.last_checkpoint
