"""The driver's end of the loop's reports: a small Ray actor on the driver's node that the workers hand their
reports to (rank 0's metrics, the checkpoint's files, written into the run folder before report() returns), and
that the driver reads from while the loops run. It also carries the driver's Ctrl-C to the next report."""

from __future__ import annotations

from typing import Any

from mixtrain.train._store import LoopCheckpoints


class ReportSink:
    def __init__(self, run_dir: str, keep: int) -> None:
        self.store = LoopCheckpoints(run_dir, keep)
        self.reports: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.stop = False
        self.last_checkpoint: str | None = None
        self._saved: set[int] = set()
        self._taken = (0, 0)

    def report(self, rank: int, index: int, metrics: dict[str, Any], files: dict[str, bytes] | None) -> bool:
        """One worker's report number `index`; returns whether the run is to stop there."""
        path = None
        if files is not None and index not in self._saved:  # the first rank to send one for this report
            path = str(self.store.save(files, {"report": index, "rank": rank, "metrics": metrics}))
            self._saved.add(index)
            self.last_checkpoint = path
        if rank == 0:
            self.reports.append({"report": index, **metrics, **({"checkpoint": path} if path else {})})
        elif path is not None:
            self.events.append(("checkpoint", {"report": index, "rank": rank, "path": path}))
        return self.stop

    def event(self, kind: str, record: dict[str, Any]) -> None:
        self.events.append((kind, record))

    def take(self) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """The reports and events since the last take."""
        reports, events = self._taken
        self._taken = (len(self.reports), len(self.events))
        return self.reports[reports:], self.events[events:]

    def request_stop(self) -> None:
        self.stop = True

    def latest(self) -> tuple[str, dict[str, bytes]] | None:
        found = self.store.latest()
        return (str(found[0]), found[1]) if found is not None else None

    def checkpoint_path(self) -> str | None:
        return self.last_checkpoint
