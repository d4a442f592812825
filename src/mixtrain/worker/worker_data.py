"""A worker's data: its training and held-out sources, the epoch's sample order, and which micro-batches of
which samples each step of a round takes on this worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mixtrain.data.sampling import Arrays, epoch_permutation, step_size, worker_indices
from mixtrain.data.sources import Loader, SampleSource, make_source
from mixtrain.devices import DeviceKind
from mixtrain.records.messages import DataReport, RoundPlan

StepChunks = tuple[int, int, list[np.ndarray]]
"""(global step, samples in the whole step, this worker's micro-batches as dataset indices)."""
Segment = tuple[list[np.ndarray], float]
"""Micro-batches of one step, then the part of an inner batch the optimizer steps on after them (0: none)."""
StepSegments = tuple[int, int, list[Segment]]
"""(global step, samples in the whole step, this worker's micro-batches in segments)."""


@dataclass
class WorkerData:
    train: SampleSource
    eval: SampleSource | None
    seed: int
    built_here: bool = False
    """The data was built on this worker from its own files (a function), so the driver compares them."""
    _perm: tuple[int, np.ndarray] = field(default=(-1, np.empty(0, dtype=np.int64)))

    @classmethod
    def empty(cls) -> WorkerData:
        return cls(SampleSource(), None, 0)

    @classmethod
    def open(
        cls, train: Arrays | Loader, evaluation: Arrays | Loader | None, seed: int, kind: DeviceKind
    ) -> WorkerData:
        options = {"supports_float64": kind.supports_float64, "pin_memory": kind.pins_memory}
        return cls(
            make_source(train, seed, **options),
            make_source(evaluation, seed, **options) if evaluation is not None else None,
            seed,
            built_here=any(isinstance(s, Loader) and s.built_on_workers for s in (train, evaluation)),
        )

    def report(self, rank: int) -> DataReport:
        """Sizes, and fingerprints of a few samples when the data was built here (the driver compares them)."""
        return DataReport(
            rank=rank,
            num_train=len(self.train),
            num_eval=len(self.eval) if self.eval is not None else 0,
            train_fingerprint=self.train.fingerprint() if self.built_here else "",
            eval_fingerprint=self.eval.fingerprint() if self.built_here and self.eval is not None else "",
        )

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm[0]:
            self._perm = (epoch, epoch_permutation(self.seed, epoch, len(self.train)))
        return self._perm[1]

    def round_chunks(self, plan: RoundPlan, rank: int, lockstep: bool = False) -> list[StepChunks]:
        """Every step of the round: this worker's samples, cut into micro-batches of at most the plan's size.
        `lockstep`: into as many micro-batches as the rank that needs most (some may be empty), so that every
        rank runs as many passes (sliced state: each pass calls collectives)."""
        perm = self.permutation(plan.epoch)
        out = []
        for step in range(plan.first_step, plan.first_step + plan.num_steps):
            indices = worker_indices(perm, plan.global_batch, step, plan.shares, rank)
            micro = plan.micro_batches[rank] if plan.micro_batches else max(1, len(indices))
            if lockstep:
                passes = max(_passes(perm, plan, step, r) for r in range(len(plan.shares)))
                chunks = list(np.array_split(indices, passes))
            else:
                chunks = [indices[lo : lo + micro] for lo in range(0, len(indices), micro)]
            out.append((step, step_size(len(perm), plan.global_batch, step), chunks))
        return out

    def close(self) -> None:
        self.train.close()
        if self.eval is not None:
            self.eval.close()


def _passes(perm: np.ndarray, plan: RoundPlan, step: int, rank: int) -> int:
    """How many micro-batches rank `rank` needs for its samples of `step` (at least one pass)."""
    n = len(worker_indices(perm, plan.global_batch, step, plan.shares, rank))
    micro = plan.micro_batches[rank] if plan.micro_batches else max(1, n)
    return max(1, -(-n // micro))


@dataclass(frozen=True)
class Pace:
    """When this worker's optimizer steps within a round, and how each micro-batch's loss is weighted for it: once
    per global step (`inner` None: each loss weighted by its samples / the step's global batch), or every `inner`
    samples of its own whatever its share (local SGD at per-device pace: weighted by samples / `inner`, gradients
    adding up across global steps until an inner batch is full)."""

    inner: int | None = None

    @property
    def per_step(self) -> bool:
        """One update per global step (the gradients are zeroed before each)."""
        return self.inner is None

    def grad_weight(self, samples: int, step_total: int) -> float:
        """The factor on a micro-batch's mean loss for its backward."""
        return samples / (self.inner if self.inner is not None else step_total)

    def segments(self, steps: list[StepChunks], flush_after: list[bool]) -> list[StepSegments]:
        """The round's steps as segments, each ending with an inner step of that fraction of an inner batch (0:
        none): one segment per step at one update per step, else cut where an inner batch fills (`flush_after`:
        the steps after which what has been gathered steps anyway, at an exchange and the round's end)."""
        if self.inner is None:
            return [(step, total, [(chunks, 0.0)]) for step, total, chunks in steps]
        return paced_segments(steps, self.inner, flush_after)


PER_STEP = Pace()
"""One update per global step: every strategy's pace but local SGD's per-device one."""


def paced_segments(steps: list[StepChunks], inner: int, flush_after: list[bool]) -> list[StepSegments]:
    """Per-device pace (local SGD): the round's micro-batches cut where an inner batch of `inner` samples
    fills, so the optimizer steps every `inner` samples of this worker whatever its share of each global step,
    and on what is left after each step `flush_after` marks (an exchange, the round's end). A step's segments
    each end with an inner step, but its last, which may end with none (0)."""
    out = []
    fill = 0
    for (step, total, chunks), flush in zip(steps, flush_after, strict=True):
        segments: list[Segment] = []
        current: list[np.ndarray] = []
        for chunk in chunks:
            lo = 0
            while lo < len(chunk):
                take = min(len(chunk) - lo, inner - fill)
                current.append(chunk[lo : lo + take])
                fill, lo = fill + take, lo + take
                if fill == inner:
                    segments.append((current, 1.0))
                    current, fill = [], 0
        if flush and fill:
            segments.append((current, fill / inner))
            current, fill = [], 0
        elif current:
            segments.append((current, 0.0))
        out.append((step, total, segments))
    return out
