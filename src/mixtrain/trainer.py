"""Trainer.fit(): connect, start the workers, run the rounds, save the result. Glue only."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray

from mixtrain import frozen_base
from mixtrain._files import RunFolder
from mixtrain.callbacks import Callback, EarlyStopping, RunEnded, RunStarted, is_run_id
from mixtrain.checkpoint import MANIFEST, CheckpointMeta, CheckpointStore, save_final_weights
from mixtrain.cluster import connect
from mixtrain.comm.state_transfer import pack, unpack
from mixtrain.comm.strategy import tensor_bytes
from mixtrain.config import RunConfig, ScalingConfig, StrategyConfig, StrategyName, check_together
from mixtrain.data.sampling import Arrays, steps_per_epoch
from mixtrain.data.sources import Loader, describe, known_length
from mixtrain.driver.bringup import Bringup, Phases, bring_up
from mixtrain.driver.controller import Controller, Policies
from mixtrain.driver.hooks import Hooks, check_callbacks
from mixtrain.driver.interrupt import GracefulStop
from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.group.worker_calls import WorkerCalls
from mixtrain.group.worker_group import WorkerGroup
from mixtrain.loggers._tensorboard import TensorBoardLogger, check_tensorboard, summary_writer_class
from mixtrain.observe.progress import ProgressView, plan_table, probe_memory_line
from mixtrain.observe.runlog import RunLog, make_run_dir
from mixtrain.policies.planner import plan_record, resolve_shares
from mixtrain.pretrained import save_final_hf_model
from mixtrain.records.run_state import RunSettings
from mixtrain.records.tunables import Tunables
from mixtrain.result import Result
from mixtrain.task import Task


class Trainer:
    """Data-parallel training of one model over Ray workers, with the math of one big batch.

    Example::

        trainer = Trainer(make_task, (x, y), global_batch=64, eval_data=(x_test, y_test),
                          scaling=ScalingConfig(num_workers=2))
        result = trainer.fit(epochs=10)
    """

    worker_group_cls = WorkerGroup

    def __init__(
        self,
        task_factory: Callable[[], Task],
        train_data: Any,
        *,
        global_batch: int,
        eval_data: Any = None,
        scaling: ScalingConfig | None = None,
        run: RunConfig | None = None,
        strategy: str | StrategyConfig = "allreduce",
        callbacks: Sequence[Callback] | None = None,
    ) -> None:
        if not callable(task_factory):
            raise InputTypeError(
                "task_factory must be a callable that returns mixtrain.Task(model=..., optimizer=..., loss_fn=...)"
            )
        if not isinstance(global_batch, int) or global_batch < 1:
            raise InputValueError(f"global_batch={global_batch!r}: must be an integer >= 1")
        if isinstance(strategy, str):
            strategy = StrategyConfig(name=cast(StrategyName, strategy))  # checks the name
        if not isinstance(strategy, StrategyConfig):
            raise InputTypeError(f"strategy={strategy!r}: give a name or a mixtrain.StrategyConfig")
        scaling = scaling or ScalingConfig()
        check_together(scaling, strategy)
        run = run or RunConfig()
        check_tensorboard(run.tensorboard)
        if not scaling.is_auto:  # check now; with groups="auto" the worker count comes from the cluster
            resolve_shares(scaling.shares, global_batch, scaling.num_workers)
        self.train_data = describe(train_data, "train_data")
        self.eval_data = describe(eval_data, "eval_data") if eval_data is not None else None
        self.task_factory = task_factory
        self.global_batch = global_batch
        self.scaling = scaling
        self.run = run
        self.strategy = strategy
        self.callbacks = check_callbacks(callbacks)

    def fit(self, epochs: int = 1, resume: str | Path | None = None) -> Result:
        """Train until `epochs` epochs are done. `resume`: a run folder (its newest good checkpoint) or one
        checkpoint folder; training continues exactly where it stopped, in that run folder unless
        RunConfig names another. Ctrl-C (or SIGTERM) stops at the next round boundary with a checkpoint and
        raises TrainingInterrupted, whose message is the resume command; a second one stops at once."""
        if not isinstance(epochs, int) or epochs < 1:
            raise InputValueError(f"epochs={epochs!r}: must be an integer >= 1")
        t_start = time.perf_counter()
        warnings: list[str] = []
        resumed = self._load_resume(resume, epochs, warnings) if resume is not None else None
        run_dir = make_run_dir(self.run, resuming=resumed is not None)
        tunables = Tunables.from_env()  # once per fit: a variable changed mid-run changes nothing
        phases = Phases()
        connect.ensure_ray(self.scaling.address, _cpus_needed(self.scaling))
        phases.mark("Ray")
        group = self.worker_group_cls(self.scaling, self.run.seed, tunables)
        group.log_dir = run_dir / "logs"
        hooks = Hooks([*self.callbacks, *self._tensorboard()], global_batch=self.global_batch)
        try:
            with GracefulStop() as stop:
                start = _Start(run_dir, _run_id(resumed, warnings), resumed, epochs, warnings, phases)
                controller, up, state = self._train(group, start, stop, hooks)
            model_path = save_final_weights(state, run_dir, controller.last_checkpoint, controller.view.log)
            hf_model_path = save_final_hf_model(state, up.hf_model, run_dir, controller.view.log)
            _save_best_hf_model(controller.best_checkpoint, up.hf_model, run_dir, controller.view.log)
        except BaseException as exc:
            hooks.run_ended(RunEnded(run_dir, error=exc))
            raise
        result = Result(
            run_dir=run_dir,
            model_path=model_path,
            state_dict=state,
            history=[record.as_dict() for record in controller.history],
            evals=controller.evals,
            workers=[w.as_dict() for w in up.workers],
            seconds_to_first_step=controller.started_at - t_start,
            best_checkpoint=controller.best_checkpoint,
            stopped_early=controller.stopped_early,
            hf_model_path=hf_model_path,
        )
        hooks.run_ended(RunEnded(run_dir, result=result, stopped_early=controller.stopped_early))
        return result

    def _tensorboard(self) -> list[Callback]:
        """RunConfig.tensorboard's logger (True: always, None: when tensorboardX or tensorboard is installed),
        after the user's callbacks (their saved states are matched by position), unless they gave one."""
        wanted = self.run.tensorboard
        given = any(isinstance(cb, TensorBoardLogger) for cb in self.callbacks)
        if given or wanted is False or (wanted is None and summary_writer_class() is None):
            return []
        return [TensorBoardLogger()]

    def _train(
        self, group: WorkerGroup, start: _Start, stop: GracefulStop, hooks: Hooks
    ) -> tuple[Controller, Bringup, Any]:
        """Bring the workers up, train, and fetch the final weights; the workers stop whatever happens."""
        view, log, interrupted, finished = ProgressView(False, 0), None, False, False
        try:
            group.start()
            up = self._bring_up(group, start.phases)
            self._check_evaluation(up.num_eval)
            num_steps = steps_per_epoch(up.num_samples, self.global_batch)
            epochs = start.epochs if self.run.max_steps is None else -(-self.run.max_steps // num_steps)
            log = self._open_log(start.run_dir, up, epochs, start.run_id)
            total = up.num_samples * epochs
            if self.run.max_steps is not None:
                total = min(total, self.run.max_steps * self.global_batch)
            view = ProgressView(self.run.progress, total, epochs)
            self._announce(view, up, start.run_dir, epochs, start.warnings)
            hooks.steps_per_epoch, hooks.num_samples, hooks.say = num_steps, up.num_samples, view.log
            position, driver_state = (0, 0), None
            if start.resumed is not None:
                position, driver_state = _restore(group, up, start.resumed, view, self.global_batch)
            settings = self._settings(up, start.run_id)
            controller = Controller(
                up.ops,
                settings,
                group.tunables,
                Policies.for_run(settings, group.tunables),
                log=log,
                view=view,
                checkpoints=CheckpointStore(start.run_dir, self.run.keep_checkpoints, base=up.frozen),
                stop=stop,
                hooks=hooks,
            )
            if start.resumed is not None:
                controller.load_driver_state(driver_state)
            hooks.run_started(self._started(start, epochs, num_steps, controller.global_step(*position)))
            stop.arm()
            controller.run(epochs, position)
            weights = _final_weights(group, up)
            finished = True
            return controller, up, weights
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            view.close()
            group.shutdown(quick=interrupted, finished=finished)
            if log is not None:
                log.close()

    def _started(self, start: _Start, epochs: int, num_steps: int, global_step: int) -> RunStarted:
        """What the callbacks hear as the run starts: its folder, id, config.json, length and where it begins."""
        with RunFolder(start.run_dir) as folder:
            config = folder.read_json("config.json")
        resumed_from = start.resumed[2] if start.resumed is not None else None
        return RunStarted(
            start.run_dir, start.run_id, config, epochs, self.run.max_steps, num_steps, global_step, resumed_from
        )

    def _load_resume(self, resume: str | Path, epochs: int, warnings: list[str]) -> Resumed:
        resumed = load_resume(resume, warnings.append)
        _, manifest, ckpt_path = resumed
        _check_resumable(CheckpointMeta.from_manifest(manifest), str(resume), self, epochs, ckpt_path)
        if self.run.run_dir is None and self.run.name is None:
            self.run = replace(self.run, run_dir=str(ckpt_path.parent.parent))
        return resumed

    def _open_log(self, run_dir: Path, up: Bringup, epochs: int, run_id: str) -> RunLog:
        config = {
            "run_id": run_id,
            "scaling": up.ops.group.scaling,  # resolved: groups="auto" became concrete groups
            "run": self.run,
            "global_batch": self.global_batch,
            "epochs": epochs,
            "strategy": up.strategy,
            "strategy_requested": self.strategy.name,
            "strategy_advice": up.advice,
            "backend": up.backend,
            "shares": up.plan.shares,
            "num_samples": up.num_samples,
            "hf_model": up.hf_model,  # a Hugging Face model's class and config: `mixtrain export` rebuilds it
        }
        log = RunLog(run_dir, config)
        log.write("workers", {"workers": up.workers})
        log.write("preflight", up.checks)
        log.write("plan", {"after_round": 0, **plan_record(up.plan)})
        log.write("startup", {"seconds": up.phases.seconds})
        return log

    def _announce(self, view: ProgressView, up: Bringup, run_dir: Path, epochs: int, warnings: list[str]) -> None:
        view.log(
            f"mixtrain: {len(up.workers)} worker{'s' * (len(up.workers) != 1)}, global batch {self.global_batch}, "
            f"{up.num_samples} samples x {epochs} epochs, {up.backend}; run folder {run_dir}"
        )
        view.log(plan_table(up.plan, up.workers, "plan", up.left_out))
        view.log(probe_memory_line(up.workers, up.probes))
        view.log(up.phases.line())
        view.log(up.strategy_line())
        for note in [*up.notes, *warnings]:
            view.log(note)
        if slowdown := self.scaling.slowdown():
            view.log(f"EMULATION: rank -> (times slower, from round) {slowdown} (MIXTRAIN_EMULATE_SLOWDOWN)")

    def _settings(self, up: Bringup, run_id: str) -> RunSettings:
        scaling = up.ops.group.scaling
        return RunSettings(
            run_id=run_id,
            seed=self.run.seed,
            data_fingerprint=_data_fingerprint(self.train_data),
            num_samples=up.num_samples,
            global_batch=self.global_batch,
            steps_per_round=self.run.steps_per_round,
            steps_per_exchange=up.strategy.steps_per_exchange,
            min_round_steps=up.strategy.min_round_steps,
            drift_tolerance=self.run.drift_tolerance,
            num_eval=up.num_eval,
            balanced=scaling.balanced,
            leave_out_slow=scaling.leave_out_slow,
            rejoin=self.run.rejoin,
            checkpoint_every_s=self.run.checkpoint_every_s,
            max_failures=self.run.max_failures,
            max_nonfinite_steps=self.run.max_nonfinite_steps,
            plan_tables=self.run.plan_tables,
            max_steps=self.run.max_steps,
            eval_every=self.run.eval_every,
            keep_best=self.run.keep_best,
            memory_caps=tuple(caps) if (caps := scaling.memory_caps()) else None,
        )

    def plan(self) -> Bringup:
        """Start the workers, measure every device and the communication, make the first plan, and stop:
        what `fit` would do before its first step, without training. `plan_table` prints the result."""
        connect.ensure_ray(self.scaling.address, _cpus_needed(self.scaling))
        group = self.worker_group_cls(self.scaling, self.run.seed)
        planned = False
        try:
            group.start()
            up = self._bring_up(group)
            planned = True
            return up
        finally:
            group.shutdown(finished=planned)

    def _check_evaluation(self, num_eval: int) -> None:
        """keep_best and EarlyStopping read held-out metrics: refuse them before training when there are none."""
        wants = ["RunConfig.keep_best"] if self.run.keep_best else []
        wants += [type(cb).__name__ for cb in self.callbacks if isinstance(cb, EarlyStopping)]
        if wants and not num_eval:
            raise InputValueError(
                f"{' and '.join(wants)} compare held-out metrics, but this run has no held-out data: give eval_data "
                "(a job function's Job(eval_data=...)), or drop them"
            )

    def _bring_up(self, group: WorkerGroup, phases: Phases | None = None) -> Bringup:
        return bring_up(
            group,
            self.task_factory,
            self.train_data,
            self.eval_data,
            self.global_batch,
            self.strategy,
            phases,
            eval_every=self.run.eval_every,
        )


Resumed = tuple[dict[str, Any], dict[str, Any], Path]
"""(state, manifest, path) of the checkpoint a run resumes from."""


@dataclass(frozen=True)
class _Start:
    """What fit() settled before the workers start."""

    run_dir: Path
    run_id: str
    resumed: Resumed | None
    epochs: int
    warnings: list[str]
    phases: Phases


def load_resume(resume: str | Path, warn: Callable[[str], None]) -> Resumed:
    """(state, manifest, path) from a run folder's newest good checkpoint, or from one checkpoint folder."""
    path = Path(resume)
    if (path / MANIFEST).is_file():
        state, manifest = CheckpointStore.read(path)
        CheckpointMeta.from_manifest(manifest)
        return state, manifest, path
    if not path.is_dir():
        raise InputValueError(f"resume={str(resume)!r}: no such folder; give a run folder or one of its checkpoints")
    return CheckpointStore(path).latest(warn, accept=CheckpointMeta.from_manifest)  # a malformed one: the previous


def _check_same_data(meta: CheckpointMeta, num_samples: int, global_batch: int, path: Path) -> None:
    """The checkpoint's (epoch, step) must mean the same samples now: as many per epoch, a step inside the epoch."""
    if meta.num_samples and meta.num_samples != num_samples:
        raise InputValueError(
            f"resume: the checkpoint {path} was trained on {meta.num_samples} samples per epoch, the data now has "
            f"{num_samples}; its (epoch {meta.epoch}, step {meta.step}) would point at other samples. Resume "
            "with the same training data, or start a new run"
        )
    num_steps = steps_per_epoch(num_samples, global_batch)
    if meta.step > num_steps:
        raise InputValueError(
            f"resume: the checkpoint {path} continues at step {meta.step} of epoch {meta.epoch}, but an epoch of "
            f"{num_samples} samples has {num_steps} steps of {global_batch}: it was trained on other data or "
            "with another batch. Resume with those, or start a new run"
        )


def _data_fingerprint(spec: Arrays | Loader) -> str:
    """A short hash of in-memory training data: each field's dtype and shape and 16 rows spread over it (cheap
    however large the data). "" for a Dataset (read on the workers, not here) or arrays of Python objects."""
    if isinstance(spec, Loader) or any(a.dtype.hasobject for a in spec):
        return ""
    n = len(spec[0])
    rows = np.unique(np.linspace(0, n - 1, num=min(n, 16)).astype(np.int64))
    digest = hashlib.sha256()
    for a in spec:
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(np.ascontiguousarray(a[rows]).tobytes())
    return digest.hexdigest()[:16]


def _run_id(resumed: Resumed | None, warnings: list[str]) -> str:
    """A resumed run keeps its id; a new run gets one (in config.json and every checkpoint's manifest). An id read
    from a checkpoint that does not look like one (is_run_id) is replaced: loggers pick a tracker's run by it."""
    if resumed is not None:
        run_id = CheckpointMeta.from_manifest(resumed[1]).run_id
        if is_run_id(run_id):
            return run_id
        if run_id:
            warnings.append(
                f"the checkpoint's run id {run_id[:80]!r} is not letters and digits; this run gets a new one"
            )
    return uuid.uuid4().hex[:12]


def _save_best_hf_model(best: Path | None, hf_model: Any, run_dir: Path, say: Callable[[str], None]) -> None:
    """The best checkpoint's weights as a Hugging Face folder too (RUN_DIR/hf_best), for a Hugging Face model."""
    if best is not None and hf_model is not None:
        save_final_hf_model(CheckpointStore.read(best)[0]["model"], hf_model, run_dir, say, name="hf_best")


def _cpus_needed(scaling: ScalingConfig) -> float:
    if scaling.is_auto:
        return 0.0
    return sum(g.resources()["CPU"] * g.num_workers for g in scaling.device_groups())


def _final_weights(group: WorkerGroup, up: Bringup) -> Any:
    """The trained weights, on the driver: where every worker holds a slice of them, each sends its own;
    else the nearest worker streams its whole state dict."""
    if up.ops.slices_weights:
        return up.ops.full_state()["model"]
    stall_s = group.tunables.collective_timeout_s
    return unpack(group.receive(group.nearest(), WorkerCalls.stream_state_dict, stall_s=stall_s))


def _check_resumable(meta: CheckpointMeta, resume: str, trainer: Trainer, epochs: int, ckpt_path: Path) -> None:
    """A checkpoint this run may go on from: something left to train, and the global batch, seed and training data
    it was trained with (else the same step would mean other samples); each refusal in one line with the fix."""
    if trainer.run.max_steps is not None and meta.global_step >= trainer.run.max_steps:
        raise InputValueError(
            f"resume={resume!r}: its checkpoint is at global step {meta.global_step}; "
            f"RunConfig.max_steps={trainer.run.max_steps} has nothing left to do: ask for more steps (--max-steps)"
        )
    if trainer.run.max_steps is None and (meta.epoch, meta.step) >= (epochs, 0):
        raise InputValueError(
            f"resume={resume!r}: its checkpoint is at epoch {meta.epoch}, step {meta.step}; "
            f"fit(epochs={epochs}) has nothing left to do: ask for more epochs"
        )
    if meta.global_batch and meta.global_batch != trainer.global_batch:
        raise InputValueError(
            f"resume={resume!r}: its checkpoint was trained with global_batch={meta.global_batch}, this run "
            f"asks for {trainer.global_batch}; step {meta.step} of epoch {meta.epoch} means other samples with "
            f"another batch. Resume with --global-batch {meta.global_batch} (global_batch={meta.global_batch}), "
            "or start a new run"
        )
    if meta.seed is not None and meta.seed != trainer.run.seed:
        raise InputValueError(
            f"resume={resume!r}: its checkpoint was trained with seed {meta.seed}, this run asks for "
            f"RunConfig.seed={trainer.run.seed}; the seed fixes every epoch's sample order (and a job's split into "
            f"training and held-out data), so step {meta.step} of epoch {meta.epoch} would mean other samples. "
            f"Resume with --seed {meta.seed} (RunConfig.seed={meta.seed}), or start a new run"
        )
    num_samples = known_length(trainer.train_data)
    if num_samples is not None:  # else the workers build the data: checked once they have (_restore)
        _check_same_data(meta, num_samples, trainer.global_batch, ckpt_path)
    fingerprint = _data_fingerprint(trainer.train_data)
    if meta.data_fingerprint and fingerprint and fingerprint != meta.data_fingerprint:
        raise InputValueError(
            f"resume={resume!r}: its checkpoint was trained on other training data (fingerprint "
            f"{meta.data_fingerprint}, the data now: {fingerprint}, from dtypes, shapes and rows spread over "
            f"it); step {meta.step} of epoch {meta.epoch} would mean other samples. Resume with the same "
            "training data, or start a new run"
        )


def _restore(
    group: WorkerGroup, up: Bringup, resumed: Resumed, view: ProgressView, global_batch: int
) -> tuple[tuple[int, int], Any]:
    """Every worker loads the checkpoint; with as many workers as before, each gets its own random
    streams back and balanced shares continue where they were, so the run continues exactly. The group
    re-forms, so the strategy starts from the loaded state (the parameter servers load it, local SGD
    takes it as its common point). Returns where training goes on and the driver's own saved state."""
    state, manifest, path = resumed
    frozen_base.check_resume(manifest, up.frozen, path)  # a checkpoint without its base: the same base now
    rng = state.pop("rng", None)
    ranks = state.pop("ranks", None)  # what each rank held of its own (local SGD's inner optimizers)
    driver_state = state.pop("driver", None)  # the callbacks' and the best checkpoint's: the driver's
    members = group.members
    same = rng is not None and len(rng) == len(members)
    own = ranks if same and isinstance(ranks, list) and len(ranks) == len(members) else [None] * len(members)
    ref = ray.put(pack(state))  # once, not once per worker; each worker reads it in place
    group.gather(
        {r: m.worker.load_training_state(ref, rng[r] if same else None, pack(own[r])) for r, m in enumerate(members)},
        group.tunables.transfer_s(tensor_bytes(state)),  # to every node: a big model over Wi-Fi takes minutes
    )
    meta = CheckpointMeta.from_manifest(manifest)
    _check_same_data(meta, up.num_samples, global_batch, path)
    balanced = same and group.scaling.balanced and len(meta.shares) == len(members)
    if balanced and sum(meta.shares) == global_batch:
        members.set_shares(meta.shares)  # balanced shares continue where they were
    up.ops.reform()
    start = (meta.epoch, meta.step)
    view.log(f"resumed from {path} at epoch {start[0]}, step {start[1]}")
    view.start_at(min(up.num_samples, start[1] * global_batch) + start[0] * up.num_samples)
    return start, driver_state
