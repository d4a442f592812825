"""When the run writes a checkpoint, what goes into it, and what it says about resuming; the held-out split.
No Ray: the controller collects the state through its group port and hands it over."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mixtrain.checkpoint import CheckpointMeta, CheckpointStore, checkpoint_name
from mixtrain.config import ScalingConfig
from mixtrain.core.best import Best
from mixtrain.core.checkpointing import save_making_room
from mixtrain.core.membership import Membership
from mixtrain.core.run_state import RunSettings
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog
from mixtrain.policies.planner import equal_shares, largest_remainder


@dataclass
class Steps:
    """Where a run ends and when it evaluates, in global steps (epoch x steps per epoch + step): the last epoch's
    end or RunConfig.max_steps, whichever comes first; an evaluation every RunConfig.eval_every steps, or at each
    epoch's end, when there is held-out data. Rounds are cut so each of these falls on a round boundary."""

    per_epoch: int
    epochs: int = 0
    max_steps: int | None = None
    eval_every: int | None = None
    evaluates: bool = False

    def at(self, epoch: int, step: int) -> int:
        return epoch * self.per_epoch + step

    @property
    def last(self) -> int:
        end = self.epochs * self.per_epoch
        return end if self.max_steps is None else min(end, self.max_steps)

    def round_length(self, epoch: int, step: int, wanted: int) -> int:
        """`wanted` steps from (epoch, step), or fewer: up to the epoch's end, the last step, the next evaluation."""
        now = self.at(epoch, step)
        limit = min(wanted, self.per_epoch - step, self.last - now)
        if self.eval_every and self.evaluates:
            limit = min(limit, self.eval_every - now % self.eval_every)
        return limit

    def eval_due(self, epoch: int, step: int) -> bool:
        """An evaluation after `step` steps of `epoch` (the run's own end aside: it always evaluates)."""
        if not self.evaluates:
            return False
        if self.eval_every:
            return self.at(epoch, step) % self.eval_every == 0
        return step >= self.per_epoch


class Checkpoints:
    """The run's checkpoints: when one is due, writing one (making room on a full disk), the last good one."""

    def __init__(
        self,
        store: CheckpointStore | None,
        settings: RunSettings,
        *,
        log: RunLog,
        view: ProgressView,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings
        self.log = log
        self.view = view
        self.clock = clock
        self.last: Path | None = None
        """The newest checkpoint written by this run (None: none yet)."""
        self.at: tuple[int, int] | None = None
        """(epoch, step) the last one continues at."""
        self._written_at = clock()
        self.best = Best(*settings.keep_best) if settings.keep_best else None
        """The best evaluation so far and its checkpoint (RunConfig.keep_best), kept beside the newest ones."""

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def restart_clock(self) -> None:
        self._written_at = self.clock()

    def due(self) -> bool:
        """`checkpoint_every_s` have passed since the last one."""
        return self.enabled and self.clock() - self._written_at >= self.settings.checkpoint_every_s

    def due_at_epoch_end(self, epoch: int, epochs: int) -> bool:
        """At the end of `epoch` without an evaluation (one with an evaluation always gets its checkpoint, written
        after it: the controller's _evaluate_and_checkpoint): after the last epoch (so `--resume --epochs N` goes
        on from there), and otherwise when one is due by time. Not at every epoch end: an epoch of a small data
        set takes well under a second on a GPU, and a checkpoint of every one cost 13% of training in the GPU
        check's overhead step (80 ms each, 0.6 s epochs)."""
        if not self.enabled:
            return False
        return epoch + 1 == epochs or self.due()

    def write(
        self, at: tuple[int, int], state: dict[str, Any], members: Membership, num_steps: int, best: bool = False
    ) -> None:
        """Rank 0's training state and every rank's random streams (in `state`), to continue at `at`; `best`: the
        new best checkpoint (the previous best is kept until this one is in place)."""
        assert self.store is not None
        epoch, step = at
        meta = CheckpointMeta(
            epoch=epoch,
            step=step,
            global_step=epoch * num_steps + step,
            shares=members.shares(),
            num_workers=len(members),
            workers=[{"host": w.host, "device_name": w.device_name, "precision": w.precision} for w in members.infos()],
            run_id=self.settings.run_id,
            global_batch=self.settings.global_batch,
            num_samples=self.settings.num_samples,
            seed=self.settings.seed,
            data_fingerprint=self.settings.data_fingerprint,
        )
        if best:
            self.store.keep_also.add(checkpoint_name(meta.global_step))
        path = save_making_room(self.store, state, asdict(meta), self.log, self.view, self.last)
        if best and self.best is not None and path is not None:
            self.best.name = path.name
        self._keep_best()
        if path is None:
            return
        self.last, self.at = path, at
        self._written_at = self.clock()
        self.log.write("checkpoint", {"path": str(path), **asdict(meta)})

    def _keep_best(self) -> None:
        if self.store is not None:
            self.store.keep_also = {self.best.name} if self.best is not None and self.best.name else set()

    def load_best(self, saved: Any) -> None:
        """The best so far from a checkpoint a run resumes from (checked: Best.load)."""
        if self.best is not None:
            self.best.load(saved)
            self._keep_best()

    @property
    def best_path(self) -> Path | None:
        """The best checkpoint's folder (RunConfig.keep_best), when it is there."""
        if self.best is None or self.best.name is None or self.store is None:
            return None
        path = self.store.root / self.best.name
        return path if path.is_dir() else None

    def read_last(self) -> tuple[dict[str, Any], CheckpointMeta]:
        """The last checkpoint's state (without the random streams) and where it continues."""
        assert self.last is not None, "a sharded run writes one before its first step"
        state, manifest = CheckpointStore.read(self.last)
        state.pop("rng", None)
        state.pop("ranks", None)  # each rank's own: for a resume on as many workers, not a recovery
        state.pop("driver", None)  # the driver's own state: the driver has it
        return state, CheckpointMeta.from_manifest(manifest)

    def resume_hint(self, scaling: ScalingConfig) -> str:
        """Where to continue from, as the command that does it. Where the run connects is never taken from its
        folder (cli/saved_command.py), so the hint says it again."""
        if self.last is None:
            return "No checkpoint was written yet."
        where = f" --address {scaling.address}" if scaling.address else ""
        where += f" --interface {scaling.network_interface}" if scaling.network_interface else ""
        return (
            f"The last checkpoint, {self.last}, is intact; continue with "
            f"`mixtrain train --resume {self.last.parent.parent}{where}` or fit(resume=...)."
        )


EVAL_BATCH = 1024
"""The largest held-out batch a worker evaluates at once; a worker whose training micro-batch is capped by its
memory evaluates at most that many (a forward pass without gradients needs less than the step it was sized
for), and halves again if even that runs out of memory."""


def eval_split(
    num_eval: int, num_workers: int, speeds: list[float] | None, collective_s: float, round_s: float
) -> tuple[list[tuple[int, int]], float]:
    """Each worker's contiguous slice [start, stop) of the held-out set, sized by its measured speed (equal until
    every worker was measured; zeros when fewer samples than workers), and the deadline: the collective timeout
    plus twice the slowest worker's measured time for its slice (a forward pass is cheaper than the training step
    it was timed on), so a worker asleep is found out in about the collective timeout, not in half an hour."""
    measured = speeds is not None and len(speeds) == num_workers and all(v > 0 for v in speeds)
    sizes = largest_remainder(speeds, num_eval) if measured and speeds else equal_shares(num_eval, num_workers)
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    if not speeds:
        return bounds, round_s
    slowest = max((n / v for n, v in zip(sizes, speeds) if v > 0), default=0.0)
    return bounds, collective_s + 2 * slowest


def eval_batches(memory_caps: list[int | None], largest: int = EVAL_BATCH) -> list[int]:
    """Per worker, the held-out batch it starts from: EVAL_BATCH, or its training micro-batch cap when it has one."""
    return [min(largest, cap) if cap else largest for cap in memory_caps]
