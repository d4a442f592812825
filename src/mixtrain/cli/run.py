"""`mixtrain run`: your own training loop on every worker, with the worker flags of `mixtrain train`.

    mixtrain run mypkg.loops:train_func --workers 2                 # a loop function (train_loop_per_worker)
    mixtrain run mypkg.loops:train_func --loop-config '{"lr": 0.001, "epochs": 5}'
    mixtrain run train.py --workers cuda:1,mps:1 -- --epochs 5      # a torchrun script (its own flags after --)
    mixtrain run train.py --resume mixtrain_runs/loop-20261126-1200-ab12      # continue from its last checkpoint

A function target is imported here (the current folder on the path, as `python -m` does) and called on every worker
as fn(config) (or fn() when it takes no parameter). A script target runs as __main__ on every worker, as torchrun
runs it on every rank. Either way, prepare_model / prepare_data_loader / report (mixtrain.train) do the rest.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from mixtrain.cli.flags import worker_flags
from mixtrain.cli.saved_command import COMMAND_FILE, loop_target, read_record, save_loop_command
from mixtrain.errors import InputValueError
from mixtrain.signing import signed_by_me


def max_failures(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0")
    return int(text)


def add_parser(sub: Any) -> None:
    """The `run` subcommand, with the worker flags shared with `train` (cli/flags.py)."""
    run = sub.add_parser(
        "run",
        help="your own training loop on every worker: a loop function or a torchrun-style script",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="A loop uses mixtrain.train: prepare_model, prepare_data_loader, report (docs/your-own-loop.md).",
    )
    run.add_argument("target", metavar="TARGET", help="package.module:function (a training loop) or a script.py")
    run.set_defaults(script_args=[])  # what follows `--` on the command line (cli/main.py splits it off)
    run.add_argument("--loop-config", metavar="JSON", help="the loop function's config: a JSON object, or a .json file")
    run.add_argument("--run-dir", help="folder for this run's files (default mixtrain_runs/loop-TIMESTAMP)")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a loop run from its last reported checkpoint, with the same TARGET it was started with",
    )
    run.add_argument(
        "--trust-job",
        action="store_true",
        help="with --resume: continue a folder whose record of its loop is not signed with your key (a folder "
        "from someone else, or from before mixtrain signed it)",
    )
    run.add_argument("--quiet", action="store_true", help="no report lines")
    run.add_argument(
        "--max-failures",
        type=max_failures,
        default=3,
        help="lost workers survived per hour, each a restart (default 3)",
    )
    worker_flags(run)


def cmd_run(args: argparse.Namespace) -> int:
    from mixtrain.config import ScalingConfig
    from mixtrain.train import FailureConfig, RunConfig
    from mixtrain.train.torch import TorchTrainer

    if args.address:
        from mixtrain.cluster.headnode import use_cluster_token

        use_cluster_token(args.address)
    fn = _target(args.target, args.script_args)
    folder = _folder(args)
    counted = isinstance(args.workers, int)
    trainer = TorchTrainer(
        fn,
        train_loop_config=_loop_config(args.loop_config),
        scaling_config=ScalingConfig(
            num_workers=args.workers if counted else ScalingConfig.num_workers,
            groups=None if counted else args.workers,
            cpus_per_worker=args.cpus_per_worker,
            shares=args.shares,
            address=args.address,
            network_interface=args.interface,
            backend=args.backend,
        ),
        run_config=RunConfig(
            name=folder.name,
            storage_path=str(folder.parent),
            seed=args.seed,
            failure_config=FailureConfig(max_failures=args.max_failures),
            progress=not args.quiet,
        ),
    )
    if not args.resume:
        save_loop_command(folder, args.target)
    result = trainer.fit()
    shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.metrics.items())
    print(f"last report: {shown or 'none'}")
    print(f"run folder: {result.path}")
    return 0


def _folder(args: argparse.Namespace) -> Path:
    """The run's folder. One folder, one run: --resume continues its own folder, with the target it was started
    with (recorded and signed in command.json); a new run is refused a folder that holds one already."""
    from mixtrain.observe.runlog import new_run_name

    if args.trust_job and not args.resume:
        raise InputValueError("--trust-job goes with --resume RUN_DIR")
    if not args.resume:
        if args.run_dir is None:
            return Path("mixtrain_runs") / new_run_name().replace("run-", "loop-", 1)
        _check_new_folder(Path(args.run_dir), args.target)
        return Path(args.run_dir)
    if args.run_dir and Path(args.resume).absolute() != Path(args.run_dir).absolute():
        raise InputValueError("--resume RUN_DIR continues in that folder: leave out --run-dir")
    if not (Path(args.resume) / "checkpoints").is_dir():
        raise InputValueError(f"--resume {args.resume!r}: no checkpoints there; give the folder a loop run reported to")
    _check_same_loop(args.resume, args.target, args.trust_job)
    return Path(args.resume)


def _check_new_folder(folder: Path, target: str) -> None:
    """A new run's --run-dir: refused when it holds checkpoints, or the record of another loop (the same loop's,
    from a start that never reported a checkpoint, is started over)."""
    record = read_record(folder) if os.path.lexists(folder / COMMAND_FILE) else None
    was = record.get("target") if isinstance(record, dict) else None
    other = record is not None and was != loop_target(target)
    if os.path.lexists(folder / "checkpoints") or other:
        raise InputValueError(
            f"--run-dir {str(folder)!r} holds a run already{f' (of {was})' if isinstance(was, str) else ''}: "
            f"continue it with mixtrain run {was if isinstance(was, str) else target} --resume {folder}, or name "
            "a new folder"
        )


def _check_same_loop(resume: str, target: str, trusted: bool) -> None:
    """The folder's record (None: a loop run started from Python, which records none) names the target it ran."""
    record = read_record(resume)
    where = Path(resume) / COMMAND_FILE
    if record is None:
        return
    was = record.get("target") if isinstance(record, dict) else None
    if not isinstance(was, str) or record.get("command") != "run":
        raise InputValueError(f"--resume {resume!r}: {where} is not the record of a `mixtrain run` loop")
    if not trusted and not signed_by_me(record):
        raise InputValueError(
            f"--resume {resume!r}: {where} is not signed with your key (unsigned, edited, or written by another user "
            f"or machine); it says the folder holds a run of {was}. Check the folder, then add --trust-job"
        )
    if was != loop_target(target):
        raise InputValueError(
            f"--resume {resume!r} holds a run of {was}, not of {loop_target(target)}: one folder holds one run. "
            f"Continue it with mixtrain run {was} --resume {resume}, or start a new run with another --run-dir"
        )


def _target(target: str, args: list[str]) -> Any:
    """The loop: a script, or a package.module:function (imported the way `mixtrain train` imports a job)."""
    if target.endswith(".py"):
        from mixtrain.train._script import ScriptLoop

        return ScriptLoop.from_file(target, args)
    if args:
        raise InputValueError(f"mixtrain run {target}: arguments after TARGET are for a script.py only")
    if ":" not in target:
        raise InputValueError(
            f"mixtrain run {target!r}: give package.module:function (a training loop) or a file ending in .py"
        )
    from mixtrain.job import import_target

    return import_target(target, "TARGET")


def _loop_config(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    source = Path(text).read_text() if text.endswith(".json") and Path(text).is_file() else text
    try:
        value = json.loads(source)
    except ValueError as exc:
        raise InputValueError(f"--loop-config: not a JSON object ({exc}); e.g. '{{\"lr\": 0.001}}'") from None
    if not isinstance(value, dict):
        raise InputValueError(f"--loop-config: a JSON object, not {type(value).__name__}")
    return value
