"""Weights & Biases as a Callback: the run's settings as the W&B config, its metrics per round and evaluation.

Offline by default (nothing leaves the machine, no login): the run is written to RUN_DIR/wandb/offline-run-*/
and uploaded later with `wandb sync RUN_DIR/wandb/offline-run-*`. mode="online" (or WANDB_MODE=online) logs
live; an unreachable server costs MIXTRAIN_WANDB_INIT_TIMEOUT_S once, then training goes on without W&B."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, cast

from mixtrain import _checks as check
from mixtrain._constants import WANDB_INIT_TIMEOUT_S, env_float
from mixtrain._files import RunFolder
from mixtrain.callbacks import Callback, Evaluated, RoundEnded, RunEnded, RunStarted, is_run_id
from mixtrain.errors import InputValueError, require
from mixtrain.loggers._scalars import eval_scalars, round_scalars
from mixtrain.observe.runlog import plain

Mode = Literal["offline", "online", "disabled"]
MODES = ("offline", "online", "disabled")
STEP = "global_step"
"""Every metric's x axis: W&B's own step must only grow, which a resumed run (it repeats the rounds after its
checkpoint) would break; a metric of its own may go back."""


class WandbLogger(Callback):
    """One W&B run per mixtrain run, with the mixtrain run id as its id (a resumed run continues it).

    config      RunStarted.config (scaling, run, strategy, global_batch, epochs, shares, ...)
    metrics     train/loss, train/samples_per_s, train/grad_norm, train/lr/group<i>, samples_per_s/<device>,
                share/<device> each round; held_out/<metric> each evaluation; x axis global_step (samples_seen too)
    summary     stopped_early when a callback stopped the run; the run exits with code 1 when it failed
    """

    def __init__(
        self,
        project: str = "mixtrain",
        *,
        mode: Mode | None = None,
        name: str | None = None,
        entity: str | None = None,
        tags: list[str] | None = None,
        save_dir: str | Path | None = None,
    ) -> None:
        require("wandb", "wandb", "wandb", "WandbLogger (--logger wandb)")
        check.text("WandbLogger.project", project)
        chosen = mode or os.environ.get("WANDB_MODE") or "offline"
        check.choice("WandbLogger.mode (or WANDB_MODE)", chosen, MODES)
        check.text("WandbLogger.name", name, none=True)
        check.text("WandbLogger.entity", entity, none=True)
        self.project, self.name, self.entity = project, name, entity
        self.mode = cast(Mode, chosen)
        if self.mode == "online":
            _check_login()
        self.tags = list(tags or [])
        self.save_dir = Path(save_dir) if save_dir is not None else None
        """Where wandb writes its folder (`wandb/`): the run folder unless given."""
        self.run: Any = None
        """The wandb Run once started (None before, or when the start failed: nothing is logged then)."""

    def on_run_start(self, event: RunStarted) -> None:
        import wandb

        if self.save_dir is None:  # W&B writes into RUN_DIR/wandb: made 0700, refused where it is a planted link
            with RunFolder(event.run_dir) as folder:
                folder.folder("wandb")
        settings = wandb.Settings(
            console="off",  # the progress view redraws the terminal: not a log to copy
            silent=True,
            init_timeout=env_float(WANDB_INIT_TIMEOUT_S),
        )
        run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.name or event.run_dir.name,
            id=event.run_id if is_run_id(event.run_id) else None,  # from the folder: a W&B run of ours only
            resume="allow",
            mode=self.mode,
            dir=str(self.save_dir or event.run_dir),
            config=plain(event.config, str),
            tags=self.tags,
            reinit="create_new",  # each fit() its own run, never the last one's
            settings=settings,
        )
        run.define_metric(STEP)
        run.define_metric("*", step_metric=STEP)
        if event.resumed_from is not None:
            run.summary["resumed_from"] = str(event.resumed_from)
        self.run = run

    def on_round_end(self, event: RoundEnded) -> None:
        self._log(round_scalars(event), event.global_step, event.samples_seen)

    def on_eval_end(self, event: Evaluated) -> None:
        self._log(eval_scalars(event), event.global_step, event.samples_seen)

    def _log(self, values: dict[str, float], step: int, samples: int) -> None:
        if self.run is not None:
            self.run.log({STEP: step, "samples_seen": samples, **values})

    def on_run_end(self, event: RunEnded) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if event.stopped_early:
            run.summary["stopped_early"] = event.stopped_early
        if event.error is not None:
            run.summary["error"] = f"{type(event.error).__name__}: {event.error}"
        run.finish(exit_code=1 if event.error is not None else 0)


def _check_login() -> None:
    """Online: W&B must have an API key now, before any worker starts, while the terminal is free: wandb.init
    would ask for one in the middle of the run, the workers waiting, or fail there."""
    if os.environ.get("WANDB_API_KEY"):
        return
    import wandb

    try:
        logged_in = wandb.login(verify=False, prompt=False)  # the key it has (netrc), without asking or checking
    except Exception:
        logged_in = False
    if not logged_in:
        raise InputValueError(
            "WandbLogger(mode='online') (or WANDB_MODE=online): no W&B API key is configured; run `wandb login` "
            "(or set WANDB_API_KEY), or log offline (mode='offline', the default) and upload the run later with "
            "`wandb sync RUN_DIR/wandb/offline-run-*`"
        )
