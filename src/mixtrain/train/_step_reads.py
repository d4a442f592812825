"""A prepared loader's reads: this worker's batch of each step of an epoch, cut by the shares in force.

A Dataset is read through ONE DataLoader, built once with the user's options, whose batch sampler cuts each step as
the loader's processes ask for it: its processes start and end as the user's own loader's would (once an epoch, or
once a run with persistent_workers), whatever the shares do within the epoch. (A new DataLoader at every move of the
shares forked new loader processes out of the worker, with torch and Ray in it, at steps 2, 4, 8, ...: issue 45.)
The processes read ahead (prefetch_factor batches each), so a move of the shares finds a few steps already cut by
the old ones: those batches are dropped and their steps read here, by the new cut, so every step holds the same
samples on every worker whatever the split.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from mixtrain.data.sampling import worker_indices
from mixtrain.data.sources import _Seeded

_END = object()


class EpochCut:
    """One epoch's steps for this worker: each step's slice of the epoch's order under the shares in force."""

    def __init__(self, order: np.ndarray, global_batch: int, steps: int, rank: int, shares: list[int]) -> None:
        self.order, self.global_batch, self.rank = order, global_batch, rank
        self.steps = steps  # the epoch's: without the last, partial one where the loader drops it
        self.shares = shares
        self.version = 0
        """How many times the shares moved this epoch (a batch cut under an older version is stale)."""

    def indices(self, step: int) -> np.ndarray:
        return worker_indices(self.order, self.global_batch, step, self.shares, self.rank)

    def move(self, shares: list[int]) -> None:
        self.shares = shares
        self.version += 1


class TensorReads:
    """Tensors in memory (a TensorDataset with the default collate function): indexed in one go, as a DataLoader
    would batch them but without a call per sample (a sample's random streams cannot matter there)."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.tensors = tensors

    def start(self, epoch: int, cut: EpochCut) -> None:
        pass

    def take(self, step: int, idx: np.ndarray) -> Any:
        index = torch.from_numpy(idx)
        return tuple(t[index] for t in self.tensors)

    def end(self) -> None:
        pass


class _StepKeys:
    """The batch sampler: the epoch's steps for this worker, each cut when the loader asks for it, each sample's
    key `(epoch, index)` (its random streams are seeded from it); `sent` notes (step, cut version) of each batch
    asked for, in order, as the loader hands the batches back in that order."""

    def __init__(self) -> None:
        self.epoch = 0
        self.cut: EpochCut | None = None
        self.sent: deque[tuple[int, int]] = deque()

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        cut, epoch = self.cut, self.epoch
        assert cut is not None, "start() names the epoch's cut before the loader is iterated"
        for step in range(cut.steps):
            idx = cut.indices(step)
            if len(idx):
                self.sent.append((step, cut.version))
                yield [(epoch, int(i)) for i in idx.tolist()]


class DatasetReads:
    """A map-style Dataset through one DataLoader with the user's options (see the module's note)."""

    def __init__(self, seeded: _Seeded, options: dict[str, Any]) -> None:
        self.seeded, self.collate = seeded, options["collate_fn"]
        self.keys = _StepKeys()
        # its own generator: the loader processes' base seeds never draw on the loop's stream (dropout stays put)
        generator = torch.Generator().manual_seed(seeded.seed)
        self.loader = DataLoader(seeded, batch_sampler=self.keys, generator=generator, **options)
        self._batches: Iterator[Any] | None = None
        self._ahead: tuple[tuple[int, int], Any] | None = None  # a batch read for a later step than asked

    def start(self, epoch: int, cut: EpochCut) -> None:
        self.keys.epoch, self.keys.cut = epoch, cut
        self.keys.sent.clear()
        self._ahead = None
        self._batches = iter(self.loader)

    def take(self, step: int, idx: np.ndarray) -> Any:
        """The batch of `idx`, this worker's samples of `step` under the cut in force."""
        cut = self.keys.cut
        assert cut is not None
        while True:
            if self._ahead is None:
                batch = next(self._batches, _END) if self._batches is not None else _END
                if batch is _END:
                    self._batches = None
                    break
                self._ahead = (self.keys.sent.popleft(), batch)  # the loader hands batches back in sampled order
            (at, version), batch = self._ahead
            if at > step:
                break  # the old cut gave this worker nothing at `step`: read it here
            self._ahead = None
            if at == step and version == cut.version:
                return batch
            # else cut before the shares moved (or a step this worker no longer reads): dropped
        return self.collate(self.seeded.__getitems__([(self.keys.epoch, int(i)) for i in idx.tolist()]))

    def end(self) -> None:
        """The epoch is over (or left): its loader processes end unless the user's loader kept them (persistent)."""
        self._batches, self._ahead = None, None
