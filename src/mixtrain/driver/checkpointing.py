"""The driver's checkpoints: when one is due, what goes into it (the workers' state, collected through the group
port, and the driver's own: callbacks, the best so far), writing it when the disk may be full, and the best one
(RunConfig.keep_best). No Ray: the controller hands over its port."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixtrain.checkpoint import CheckpointMeta, CheckpointStore, checkpoint_name
from mixtrain.config import ScalingConfig
from mixtrain.driver.best import Best
from mixtrain.driver.hooks import Hooks
from mixtrain.driver.schedule import Steps
from mixtrain.driver.states import Position, Train
from mixtrain.errors import InputValueError, MetricMissing
from mixtrain.group.membership import Membership
from mixtrain.group.port import GroupPort
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog
from mixtrain.records.run_state import RunSettings

if TYPE_CHECKING:  # changes.py asks Checkpoints for the last one; the Checkpointer asks Changes to recover
    from mixtrain.driver.changes import Changes


class Checkpointer:
    """Writes a checkpoint when one is due, and decides whether an evaluation made it the best: the workers'
    state (a worker lost meanwhile is recovered from first) and the driver's own, handed to `Checkpoints`. `save`,
    `after_evaluation` and `write` return None, or where training goes on when a recovery took it back to the last
    checkpoint."""

    def __init__(self, port: GroupPort, checkpoints: Checkpoints, steps: Steps, changes: Changes, hooks: Hooks) -> None:
        self.port = port
        self.members = port.members
        self.checkpoints = checkpoints
        self.steps = steps
        self.changes = changes
        self.hooks = hooks

    def due(self, at: Position, last: bool = False) -> bool:
        """A checkpoint to continue at `at`, unless the last one continues there: when `last` (the run's end, a
        stop, a sharded run's first one) or when checkpoint_every_s have passed. Not at every epoch's end: an
        epoch of a small data set takes well under a second on a GPU, and a checkpoint of every one cost 13% of
        training in the GPU check's overhead step (80 ms each, 0.6 s epochs). The last epoch's end is `last`, so
        `--resume --epochs N` goes on from there."""
        return self.checkpoints.enabled and self.checkpoints.at != at and (last or self.checkpoints.due())

    def save(self, at: Position, last: bool = False) -> Train | None:
        """A checkpoint to continue at `at` when one is due (`due`)."""
        return self.write(at) if self.due(at, last) else None

    def after_evaluation(self, ev: dict[str, Any] | None, at: Position) -> Train | None:
        """The checkpoint an evaluation (`ev`; None: one was already made at this step) always gets, written after
        it so it holds what the callbacks and the best made of it; marked best when RunConfig.keep_best says so
        (then written even where the last one continues)."""
        best = self._is_best(ev, at)
        if not self.checkpoints.enabled or (self.checkpoints.at == at and not best):
            return None
        return self.write(at, best=best)

    def write(self, at: Position, best: bool = False) -> Train | None:
        """Rank 0's training state, every rank's random streams and the driver's own (callbacks, best checkpoint),
        to continue at `at`. `best`: kept beside the newest ones (RunConfig.keep_best)."""
        state = self.changes.surviving("checkpoint", self._collect_state, at)
        if isinstance(state, Train):
            return state
        state["driver"] = self.driver_state(checkpoint_name(self.steps.at(*at)) if best else None)
        self.checkpoints.write(at, state, self.members, self.steps.per_epoch, best=best)
        return None

    def _collect_state(self) -> dict[str, Any]:
        state = self.port.full_state()
        state["rng"] = self.port.rng_states()
        ranks = self.port.rank_states()
        if ranks:
            state["ranks"] = ranks
        return state

    def _is_best(self, ev: dict[str, Any] | None, at: Position) -> bool:
        best = self.checkpoints.best
        missing = self.hooks.missing_metric  # EarlyStopping's metric, found missing as the eval record was written
        if missing is None and best is not None and ev is not None:
            try:
                return best.improved(ev)
            except MetricMissing as exc:
                missing = exc
        if missing is None:
            return False
        # The run's own setting names a metric the evaluation lacks: stop here, once a checkpoint holds the
        # training, and say how to go on (a plain resume would stop the same way at its first evaluation).
        self.save(at, last=True)
        kept = (
            f"the last checkpoint, {self.checkpoints.last}, holds the training so far: resume it"
            if (self.checkpoints.last is not None)
            else "start again"
        )
        raise InputValueError(
            f"{missing}. The run stopped at that evaluation; {kept} naming one of those metrics (mixtrain train "
            "--resume RUN_DIR --keep-best/--early-stopping METRIC, or fit(resume=...) with the setting changed)"
        ) from None

    def driver_state(self, new_best: str | None = None) -> str:
        """What the driver keeps in a checkpoint beside the workers' state, as JSON; `new_best`: the name of the
        checkpoint it goes into, when that one is the new best."""
        best = self.checkpoints.best
        kept = None if best is None else {**best.state(), **({"name": new_best} if new_best else {})}
        return json.dumps({"callbacks": self.hooks.state(), "best": kept})

    def load_driver_state(self, saved: Any) -> None:
        """The callbacks' state and the best checkpoint, from a checkpoint's driver_state(). (A checkpoint at an
        evaluation is written after it, and a resumed run starts with a round: nothing is evaluated twice.)"""
        try:
            driver = json.loads(saved) if isinstance(saved, str) else {}
        except ValueError:
            driver = {}
        if not isinstance(driver, dict):
            driver = {}
        self.hooks.load_state(driver.get("callbacks"))
        self.checkpoints.load_best(driver.get("best"))


class Checkpoints:
    """The run's checkpoints on disk: when one is due by time, writing one (making room on a full disk), the last
    good one, the best one kept beside the newest, and the command that resumes."""

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


def save_making_room(
    store: CheckpointStore,
    state: dict[str, Any],
    meta: dict[str, Any],
    log: RunLog,
    view: ProgressView,
    last_good: Path | None,
) -> Path | None:
    """Save; on a full disk (or another write error) drop the older checkpoints and try once more, then go on
    without this one (None): the last good checkpoint stays, and a later save may find room."""
    try:
        return store.save(state, meta)
    except OSError as exc:
        first = exc
    dropped = store.prune(keep=1)
    view.log(f"checkpoint failed ({first.strerror or first}); removed {len(dropped)} older checkpoint(s) to make room")
    try:
        return store.save(state, meta)
    except OSError as exc:
        kept = last_good or "none"
        view.log(f"checkpoint skipped ({exc.strerror or exc}); training goes on, the last good one: {kept}")
        log.write("checkpoint_failed", {"error": str(exc), "last_checkpoint": str(kept)})
        return None
