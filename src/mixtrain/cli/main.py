"""`mixtrain` subcommands: the top-level parser, and `main`, which dispatches and turns errors into exit codes.

Each subcommand's parser and command live in its own module (train.py, plan.py, run.py, machine.py for devices and
env, report.py for report and export, cluster.py); the flags several share are in flags.py.

Command lines:
    mixtrain train digits --workers 2                      # a built-in example: digits, chars, chars-large, mnist
    mixtrain train chars --workers 2 --epochs 3            # a character-level transformer
    mixtrain train mnist --data-dir ~/data/mnist           # MNIST IDX files you have
    mixtrain train mypkg.jobs:make_job --lr 1e-3           # your own job function (returns mixtrain.Job)
    mixtrain train run.toml --epochs 5                     # a TOML config file; flags override it
    mixtrain train digits --workers 3 --shares 30,20,14 --global-batch 64 --epochs 5 --run-dir runs/a
    mixtrain train digits --workers cuda:1,mps:1,cpu:2 --precision auto --address 192.168.1.10:6379
    mixtrain train --resume runs/a --epochs 20             # continue a stopped run
    mixtrain train digits --strategy local-sgd --local-steps 16 --overlap --compress int8   # a slow link
    mixtrain plan digits --workers cuda:1,mps:1            # measure and show the split, no training
    mixtrain plan chars --devices cuda:12GB,mps:16GB --link 1gbit   # what fits where, no workers
    mixtrain report runs/a                                 # plots and a summary of a run
    mixtrain devices
    mixtrain env                                           # everything a bug report needs
    mixtrain cluster up --interface eth0                   # on the desktop: prints the join command
    mixtrain cluster join 192.168.1.10:6379 --token-file auth_token   # on the Mac, with the head's token file
    mixtrain cluster status
    mixtrain cluster down
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# The F401 imports: names tests and older callers import from here; each lives in the module named.
from mixtrain.cli import cluster, machine, plan, report, run, train
from mixtrain.cli.cluster import up_message as _up_message  # noqa: F401
from mixtrain.cli.flag_types import _early_stopping, _keep_best  # noqa: F401
from mixtrain.cli.from_flags import trainer as _trainer  # noqa: F401
from mixtrain.cli.parser import Parser, other_flags, subparser
from mixtrain.cli.parser import subparser as _subparser  # noqa: F401
from mixtrain.cli.resume import check_resumed_job as _check_resumed_job  # noqa: F401
from mixtrain.cli.resume import resumed
from mixtrain.errors import InputError

BUG_REPORT = (
    "the traceback above is not a check of your input. If it points into your own job code, fix it there; "
    "otherwise it is a bug in mixtrain: please report it with this traceback and the output of `mixtrain env`"
)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": plan.cmd_plan,
    "run": run.cmd_run,
    "devices": machine.cmd_devices,
    "cluster": cluster.cmd_cluster,
    "env": machine.cmd_env,
    "report": report.cmd_report,
    "export": report.cmd_export,
}
"""Every subcommand but `train`, whose command also takes the raw command line (it saves it in the run folder)."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand's module builds its own (sub-parsers are Parsers too)."""
    parser = Parser(prog="mixtrain", description="Train one PyTorch model on every device you own.")
    parser.add_argument("--version", action="version", version=f"mixtrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    plan.add_parser(sub)
    run.add_parser(sub)
    machine.add_devices_parser(sub)
    machine.add_env_parser(sub)
    report.add_report_parser(sub)
    report.add_export_parser(sub)
    cluster.add_parser(sub)
    return parser


def _parse(raw: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse, reading a TOML config (`--config FILE` or a TASK ending in .toml) into the defaults first.
    `args.job_args` is the config's [args] table; `args.config_data` its other keys (saved in command.json).
    `mixtrain run script.py ... -- ARGS`: what follows `--` is the script's, not mixtrain's."""
    if raw[:1] == ["run"] and "--" in raw:
        cut = raw.index("--")
        args = build_parser().parse_args(raw[:cut])
        args.script_args = raw[cut + 1 :]
        return args, raw
    args = build_parser().parse_args(raw)
    args.config_data = {}
    if args.command == "train" and args.resume:
        args, saved = resumed(raw, args, build_parser())
        args.job_args, args.config_data = saved.get("job_args", {}), saved.get("config", {})
        return args, raw
    if args.command not in ("train", "plan"):
        return args, raw
    config = args.config
    if config is None and args.task and args.task.endswith(".toml"):
        config = args.task
        i = raw.index(args.task)
        raw = [*raw[:i], "--config", config, *raw[i + 1 :]]
    if config is None:
        return args, raw
    from mixtrain.cli.config_file import apply_values, read_config, split_config

    parser = build_parser()
    data, job_args = split_config(read_config(config), config)
    apply_values(subparser(parser, args.command), data, config, other_flags(parser, args.command))
    args = parser.parse_args(raw)
    args.job_args, args.config_data = job_args, data
    return args, raw


def _version() -> str:
    from mixtrain import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # a caller's own (tests): theirs
    try:
        args, raw = _parse(raw)
        if args.command == "train":
            return train.cmd_train(args, raw)
        return COMMANDS[args.command](args)
    except InputError as exc:  # bad input, found before anything started: one line
        print(f"mixtrain: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError):  # not a check of ours: a bug (ours or the job's), with its traceback
        import traceback

        traceback.print_exc()
        print(f"mixtrain: internal error: {BUG_REPORT}", file=sys.stderr)
        return 1
    except (RuntimeError, ConnectionError) as exc:  # a worker, the cluster or a timeout: a clear line, no traceback
        print(f"mixtrain: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a lost mount, a missing file: one line
        print(f"mixtrain: error: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C: TrainingInterrupted says where to resume; a second one stops at once
        from mixtrain.cluster.connect import stop_ray_uninterrupted

        print(f"mixtrain: {str(exc) or 'stopped at once'}", file=sys.stderr, flush=True)
        stop_ray_uninterrupted()
        return 130
    finally:  # however it ended: the Ray this command started (or joined) is stopped before it returns
        if not ray_was_up and "ray" in sys.modules:
            from mixtrain.cluster.connect import stop_ray_uninterrupted

            stop_ray_uninterrupted()


if __name__ == "__main__":
    sys.exit(main())
