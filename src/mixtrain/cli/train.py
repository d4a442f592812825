"""`mixtrain train`: its parser (the job flags shared with `plan`, then the run's own) and its command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixtrain.cli import from_flags
from mixtrain.cli.flag_types import _early_stopping, _keep_best, _loggers, _non_negative_int, _number, _positive_int
from mixtrain.cli.flags import from_config, job_flags
from mixtrain.cli.resume import check_resumed_job
from mixtrain.cli.saved_command import save_command
from mixtrain.errors import InputValueError


def add_parser(sub: Any) -> None:
    train = sub.add_parser(
        "train",
        help="train a built-in example, your own job function, or a TOML config",
        description="Train a job on every worker: a built-in example (digits, chars, chars-large, mnist), your own "
        "package.module:function that returns mixtrain.Job, or a TOML file whose keys are these flags' long "
        "names (flags given here override it).",
    )
    job_flags(train)
    _length_flags(train)
    _run_flags(train)
    _output_flags(train)


def _length_flags(p: argparse.ArgumentParser) -> None:
    """How long, in which folder, and continuing which run."""
    p.add_argument("--epochs", type=_positive_int, help="passes over the training data")
    p.add_argument("--steps-per-round", type=_positive_int, help="steps per driver call (default: about 1.5 s)")
    p.add_argument("--run-dir", help="folder for this run's files (default mixtrain_runs/run-TIMESTAMP)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its newest good checkpoint, with the flags it was started with (flags given "
        "now override them; --epochs is the total to reach). The run folder names the job function to run "
        "again: resuming a folder you did not make runs code. A package.module:function job is refused when "
        "the module would now be loaded from another file than when the run started, unless --trust-job",
    )
    p.add_argument(
        "--trust-job",
        action="store_true",
        help="with --resume: run the job function the run folder names even from another file than the "
        "run started with (or from a folder written before mixtrain recorded it)",
    )


def _run_flags(p: argparse.ArgumentParser) -> None:
    """Checkpoints, failures survived, evaluation and stopping (RunConfig)."""
    p.add_argument(
        "--checkpoint-every",
        type=_number(0, finite=False),
        **from_config("checkpoint_every"),
        metavar="SECONDS",
        help="write a checkpoint after the round that ends this long after the last one (default %(default)g; 0: every "
        "round); one is also written after each held-out evaluation and at the run's end",
    )
    p.add_argument(
        "--max-failures",
        type=_non_negative_int,
        **from_config("max_failures"),
        help="lost workers survived per hour before stopping (default %(default)s)",
    )
    p.add_argument(
        "--max-steps",
        type=_positive_int,
        help="stop after this many global steps (overrides --epochs; a resume continues to it)",
    )
    p.add_argument(
        "--eval-every",
        type=_positive_int,
        metavar="STEPS",
        help="evaluate every this many global steps and at the end (default: at each epoch's end)",
    )
    p.add_argument(
        "--keep-best",
        type=_keep_best,
        metavar="METRIC[:min|max]",
        help="keep the checkpoint with the best held-out METRIC beside the newest ones (e.g. loss, accuracy:max)",
    )
    p.add_argument(
        "--early-stopping",
        type=_early_stopping,
        metavar="METRIC[:min|max][:PATIENCE]",
        help="stop when the held-out METRIC has not improved for PATIENCE evaluations (default 3), e.g. loss:min:3",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    """What the run shows while it trains, and where else it logs."""
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument(
        "--plan-tables", action="store_true", help="the whole plan table at every re-plan (default: one line each)"
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="require TensorBoard event files in RUN_DIR/tensorboard (default: written when tensorboardX is installed)",
    )
    p.add_argument(
        "--logger",
        type=_loggers,
        action="extend",
        metavar="NAME",
        help="also log the run to mlflow (its store: $MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db), wandb (offline "
        "unless WANDB_MODE=online; RUN_DIR/wandb) or tensorboard (RUN_DIR/tensorboard); repeat it, or give "
        'names with commas. Each needs its extra: pip install "mixtrain[mlflow]" (wandb, tensorboard)',
    )


def cmd_train(args: argparse.Namespace, raw: list[str]) -> int:
    from mixtrain.callbacks import EVAL_KEYS
    from mixtrain.observe.runlog import check_new_run_dir, new_run_name

    run_dir = Path(args.run_dir or args.resume or Path("mixtrain_runs") / new_run_name())
    if args.resume:
        check_resumed_job(args)  # before the job's module is imported
    elif args.trust_job:
        raise InputValueError("--trust-job goes with --resume RUN_DIR")
    else:
        check_new_run_dir(run_dir)  # before command.json is written there
    job, trainer = from_flags.trainer(args, str(run_dir), args.steps_per_round)  # checks the flags first
    if not args.resume:
        save_command(raw, run_dir, from_flags.task(args)[0], args.config_data, args.job_args)
    result = trainer.fit(epochs=args.epochs or job.epochs, resume=args.resume)
    metrics = result.metrics
    summary = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k not in EVAL_KEYS)
    print(f"held-out {summary}")
    if result.stopped_early:
        print(f"stopped early: {result.stopped_early}")
    if result.best_checkpoint is not None:
        print(f"best checkpoint: {result.best_checkpoint}")
    print(f"run folder: {result.run_dir}")
    return 0
