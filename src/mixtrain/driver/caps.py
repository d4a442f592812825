"""DeviceGroup(memory=...) kept to: a worker whose peak passes its group's figure is named, once.

On CUDA and MPS the worker's allocator holds its tensors to the figure (DeviceKind.cap_memory); on the CPU nothing
holds a process to one, so the driver compares each round's peak resident set with it and says so, on the terminal
and as a `memory_over_cap` record in metrics.jsonl.
"""

from __future__ import annotations

from collections.abc import Sequence

from mixtrain.observe.progress import ProgressView, format_bytes
from mixtrain.observe.runlog import RunLog
from mixtrain.records.rounds import RoundRecord


class CapWatch:
    """Each worker's peak against its cap, by the rank it started with (its bundle)."""

    def __init__(self, caps: Sequence[int] | None, log: RunLog, view: ProgressView) -> None:
        self.caps = caps
        self.log = log
        self.view = view
        self.said: set[int] = set()

    def after_round(self, record: RoundRecord, bundles: Sequence[int]) -> None:
        """`bundles`: the starting rank of the worker at each place of `record.workers`."""
        if not self.caps:
            return
        for worker, bundle in zip(record.workers, bundles, strict=True):
            cap, peak = self.caps[bundle], worker.memory_bytes
            if peak is None or peak <= cap or bundle in self.said:
                continue
            self.said.add(bundle)
            who = worker.worker or f"worker {bundle}"
            self.log.write("memory_over_cap", {"worker": who, "bundle": bundle, "peak_bytes": peak, "cap_bytes": cap})
            self.view.log(
                f"memory: {who} peaked at {format_bytes(peak)}, over the {format_bytes(cap)} its "
                "DeviceGroup(memory=...) gives (slices follow the caps, but nothing on this device holds a process to "
                "one): give it a larger figure, or a smaller slice (ScalingConfig.shard_slices)"
            )
