"""`mixtrain` subcommands.

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
import dataclasses
import json
import math
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from mixtrain.cli.saved_command import (
    COMMAND_FILE,
    NOW_ONLY,
    REDIRECTS,
    SavedCommand,
    read_command,
    redirect_error,
    save_command,
)
from mixtrain.config import MAX_SEED, RunConfig, ScalingConfig, StrategyConfig
from mixtrain.errors import InputError, InputValueError

BUG_REPORT = (
    "the traceback above is not a check of your input. If it points into your own job code, fix it there; "
    "otherwise it is a bug in mixtrain: please report it with this traceback and the output of `mixtrain env`"
)

if TYPE_CHECKING:  # the CLI imports torch and Ray only for the commands that need them
    from mixtrain.cluster.state import NodeState
    from mixtrain.job import Job
    from mixtrain.trainer import Trainer


def _shares(text: str) -> list[int] | str:
    if text in ("auto", "equal"):
        return text
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, equal, or a comma-separated list of integers, e.g. 40,24"
        ) from None


def _micro_batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated list, e.g. 64,16") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every micro-batch must be >= 1")
    return values


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {low}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _seed(text: str) -> int:
    value = _non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} must be <= {MAX_SEED} (2**32 - 1)")
    return value


def _loggers(text: str) -> list[str]:
    from mixtrain.loggers import NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in NAMES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(NAMES)} (one, or several with commas)")
    return names


def _number(low: float, *, above: bool = False, below: float = math.inf, finite: bool = True) -> Callable[[str], float]:
    """A float flag in [low, below) ((low, below) when `above`), finite unless `finite=False`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if math.isnan(value) or (finite and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
        if value < low or (above and value == low) or value >= below:
            bound = f"> {low:g}" if above else f">= {low:g}"
            raise argparse.ArgumentTypeError(
                f"{text!r} must be {bound}" + (f" and < {below:g}" if below < math.inf else "")
            )
        return value

    return parse


_positive = _number(0, above=True)


def _text(text: str) -> str:
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is empty")
    return text


FLAG_FIELDS: dict[str, tuple[type, str]] = {
    "checkpoint_every": (RunConfig, "checkpoint_every_s"),
    "max_failures": (RunConfig, "max_failures"),
    "seed": (RunConfig, "seed"),
    "workers": (ScalingConfig, "num_workers"),
    "cpus_per_worker": (ScalingConfig, "cpus_per_worker"),
    "shares": (ScalingConfig, "shares"),
    "precision": (ScalingConfig, "precision"),
    "backend": (ScalingConfig, "backend"),
    "numerics": (ScalingConfig, "numerics_check"),
    "strategy": (StrategyConfig, "name"),
    "compress": (StrategyConfig, "compress"),
    "staleness": (StrategyConfig, "staleness"),
    "local_steps": (StrategyConfig, "local_steps"),
    "outer_lr": (StrategyConfig, "outer_lr"),
    "outer_momentum": (StrategyConfig, "outer_momentum"),
    "pace": (StrategyConfig, "pace"),
}
"""Flags whose default (and, for a field that takes a fixed set of names, whose choices) is the config field's own:
a default is written once, in config.py, and help texts show it through argparse's %(default)s."""


def _field(dest: str) -> dict[str, Any]:
    """add_argument's default= (and choices=) for the flag `dest`, from its config field."""
    cls, name = FLAG_FIELDS[dest]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    out: dict[str, Any] = {"default": field.default}
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is typing.Literal:
        out["choices"] = typing.get_args(hint)
    return out


class _Parser(argparse.ArgumentParser):
    """Every parser of the CLI: no abbreviated flags. argparse takes any unambiguous prefix by default, so a saved
    `--trust` would have meant --trust-job, and a flag added later could change what an old prefix means."""

    reading: str | None = None
    """Set while a run folder's saved flags are parsed: an error there names the file instead of ending the
    process with argparse's usage text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if _Parser.reading is not None:
            raise InputValueError(f"{_Parser.reading}: its flags do not parse ({message})")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mixtrain", description="Train one PyTorch model on every device you own.")
    parser.add_argument("--version", action="version", version=f"mixtrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)  # sub-parsers are _Parsers too
    train = sub.add_parser(
        "train",
        help="train a built-in example, your own job function, or a TOML config",
        description="Train a job on every worker: a built-in example (digits, chars, chars-large, mnist), your own "
        "package.module:function that returns mixtrain.Job, or a TOML file whose keys are these flags' long "
        "names (flags given here override it).",
    )
    _job_flags(train)
    train.add_argument("--epochs", type=_positive_int, help="passes over the training data")
    train.add_argument("--steps-per-round", type=_positive_int, help="steps per driver call (default: about 1.5 s)")
    train.add_argument("--run-dir", help="folder for this run's files (default mixtrain_runs/run-TIMESTAMP)")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its newest good checkpoint, with the flags it was started with (flags given "
        "now override them; --epochs is the total to reach). The run folder names the job function to run "
        "again: resuming a folder you did not make runs code. A package.module:function job is refused when "
        "the module would now be loaded from another file than when the run started, unless --trust-job",
    )
    train.add_argument(
        "--trust-job",
        action="store_true",
        help="with --resume: run the job function the run folder names even from another file than the "
        "run started with (or from a folder written before mixtrain recorded it)",
    )
    train.add_argument(
        "--checkpoint-every",
        type=_number(0, finite=False),
        **_field("checkpoint_every"),
        metavar="SECONDS",
        help="write a checkpoint after the round that ends this long after the last one (default %(default)g; 0: every "
        "round); one is also written after each held-out evaluation and at the run's end",
    )
    train.add_argument(
        "--max-failures",
        type=_non_negative_int,
        **_field("max_failures"),
        help="lost workers survived per hour before stopping (default %(default)s)",
    )
    train.add_argument(
        "--max-steps",
        type=_positive_int,
        help="stop after this many global steps (overrides --epochs; a resume continues to it)",
    )
    train.add_argument(
        "--eval-every",
        type=_positive_int,
        metavar="STEPS",
        help="evaluate every this many global steps and at the end (default: at each epoch's end)",
    )
    train.add_argument(
        "--keep-best",
        type=_keep_best,
        metavar="METRIC[:min|max]",
        help="keep the checkpoint with the best held-out METRIC beside the newest ones (e.g. loss, accuracy:max)",
    )
    train.add_argument(
        "--early-stopping",
        type=_early_stopping,
        metavar="METRIC[:min|max][:PATIENCE]",
        help="stop when the held-out METRIC has not improved for PATIENCE evaluations (default 3), e.g. loss:min:3",
    )
    train.add_argument("--quiet", action="store_true", help="no live progress")
    train.add_argument(
        "--plan-tables", action="store_true", help="the whole plan table at every re-plan (default: one line each)"
    )
    train.add_argument(
        "--tensorboard",
        action="store_true",
        help="require TensorBoard event files in RUN_DIR/tensorboard (default: written when tensorboardX is installed)",
    )
    train.add_argument(
        "--logger",
        type=_loggers,
        action="extend",
        metavar="NAME",
        help="also log the run to mlflow (its store: $MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db), wandb (offline "
        "unless WANDB_MODE=online; RUN_DIR/wandb) or tensorboard (RUN_DIR/tensorboard); repeat it, or give "
        'names with commas. Each needs its extra: pip install "mixtrain[mlflow]" (wandb, tensorboard)',
    )
    plan = sub.add_parser(
        "plan",
        help="measure every device and show how the batch would be split, without training",
        description="Start the workers, measure each device's speed and memory and the communication, "
        "print the plan (share, micro-batch x accumulation, predicted samples/s, memory cap, devices left out "
        "and why), and stop.",
    )
    _job_flags(plan)
    plan.add_argument(
        "--devices",
        metavar="KIND:MEMORY,...",
        help="instead of measuring the workers: the devices to plan for, present or not, e.g. cuda:12GB,mps:16GB "
        "or cpu:1.25GB (KIND:MEMORY@SAMPLES_PER_S adds a speed); prints what each would hold per slicing level, "
        "what fits, and the fastest choice, without starting Ray (docs/memory-and-big-models.md)",
    )
    plan.add_argument(
        "--link", metavar="SPEED", help="with --devices: the link between them (default 1gbit; 10gbit, 100mbit)"
    )
    plan.add_argument(
        "--blocks", type=_positive_int, help="with --devices: predict the same model shape with this many blocks"
    )
    from mixtrain.cli import run as run_command

    run_command.add_parser(sub, _worker_flags)

    sub.add_parser("devices", help="list this machine's devices", description="List this machine's devices.")
    env = sub.add_parser(
        "env",
        help="everything a bug report needs: OS, Python, torch, Ray, mixtrain, devices, network",
        description="Print the platform, versions, devices, this machine's cluster and the settings that "
        "change mixtrain's behaviour; paste it into a bug report.",
    )
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    report = sub.add_parser(
        "report",
        help="plots and a summary of a run",
        description="Write PNG plots of a run (loss and held-out metric vs. samples seen; samples/s per device; "
        "shares over time) and a short text summary, from its metrics.jsonl.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (it holds metrics.jsonl)")
    report.add_argument("--out", help="folder for the files (default RUN_DIR/report)")
    export = sub.add_parser(
        "export",
        help="a run's or a checkpoint's weights as a Hugging Face model folder",
        description="Write the weights of a run folder (its final weights) or of one of its checkpoints with "
        "save_pretrained, for AutoModel.from_pretrained; the run must have trained a transformers.PreTrainedModel.",
    )
    export.add_argument(
        "path", metavar="PATH", help="a run folder, or a checkpoint folder (RUN_DIR/checkpoints/step-N)"
    )
    export.add_argument("--out", help="the folder to write (default RUN_DIR/hf_model, or RUN_DIR/hf_step-N)")
    _add_cluster_parser(sub)
    return parser


def _job_flags(p: argparse.ArgumentParser) -> None:
    """What a job is made of: shared by `train` and `plan`."""
    p.add_argument(
        "task",
        nargs="?",
        metavar="TASK",
        help="a built-in example (digits, the default; chars; chars-large; mnist), package.module:function returning "
        "mixtrain.Job, or a .toml config file",
    )
    p.add_argument("--example", help="the same as TASK (a built-in example's name)")
    p.add_argument("--config", metavar="FILE.toml", help="read the flags from a TOML file (flags given here win)")
    p.add_argument("--data-dir", help="data folder for jobs that read files (the mnist example: its IDX files)")
    p.set_defaults(job_args={})
    _worker_flags(p)
    p.add_argument("--global-batch", type=_positive_int, help="samples per step over all workers")
    p.add_argument(
        "--max-micro-batch",
        type=_micro_batches,
        help="largest micro-batch per worker (one number for all, or one per worker, e.g. 64,16); a larger share "
        "is split with gradient accumulation (default: measured on GPUs, no limit on CPUs)",
    )
    p.add_argument(
        "--shard",
        choices=["none", "optimizer", "gradients", "full"],
        help="slice the training state over the workers by their free memory instead of keeping all of it on each: "
        "optimizer (its state, AdamW: twice the weights), gradients (also the gradients), full (also the weights, "
        "gathered one block at a time): larger models fit, the same math (allreduce only; default none)",
    )
    p.add_argument("--shard-optimizer", action="store_true", help="the same as --shard optimizer (deprecated)")
    p.add_argument(
        "--offload",
        choices=["none", "optimizer"],
        default="none",
        help="optimizer: each worker's slice of the optimizer state (and an fp32 copy of its weights) in host memory, "
        "stepped there, so a GPU holds weights, gradients and activations only (needs --shard)",
    )
    p.add_argument(
        "--keep-all-devices",
        action="store_true",
        help="never leave a worker out, even when the job is predicted faster without it",
    )
    p.add_argument("--lr", type=_positive, help="learning rate")
    p.add_argument(
        "--precision",
        **_field("precision"),
        help="fp32 (default, exact) or auto: bf16/fp16 autocast on GPUs, fp32 on CPUs",
    )
    p.add_argument(
        "--numerics",
        **_field("numerics"),
        help="start-up gradient check of each device against the CPU: warn, strict (leave bad devices out), off",
    )
    p.add_argument(
        "--strategy",
        **_field("strategy"),
        help="allreduce (default: gradients summed every step), ps (parameter servers, the same math), "
        "ps-async (parameter servers, workers up to --staleness updates ahead), local-sgd (average every "
        "--local-steps steps, DiLoCo outer step), auto (measure the link at start-up and pick allreduce, or "
        "local-sgd with H and compression)",
    )
    p.add_argument(
        "--compress",
        **_field("compress"),
        help="send gradients (allreduce, ps) or deltas (local-sgd) as bf16 or fp16 (default %(default)s: fp32); "
        "local-sgd also int8 or int4 (per-block scales, error feedback)",
    )
    p.add_argument(
        "--staleness",
        type=_non_negative_int,
        **_field("staleness"),
        help="ps-async: updates a worker may run ahead (default %(default)s; 0: synchronous)",
    )
    p.add_argument(
        "--local-steps",
        type=_positive_int,
        **_field("local_steps"),
        help="local-sgd: steps between averages (default %(default)s)",
    )
    p.add_argument(
        "--outer-lr",
        type=_positive,
        **_field("outer_lr"),
        help="local-sgd: learning rate of the outer step on the averaged delta (default %(default)s: plain averaging)",
    )
    p.add_argument(
        "--outer-momentum",
        type=_number(0, below=1),
        **_field("outer_momentum"),
        help="local-sgd: Nesterov momentum of the outer step (default %(default)s; DiLoCo: --outer-lr 0.7 "
        "--outer-momentum 0.9)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="local-sgd: exchange in the background while the next --local-steps steps compute, applying the "
        "average one exchange late (a slow link)",
    )
    p.add_argument(
        "--pace",
        **_field("pace"),
        help="local-sgd on unequal devices: balanced (default: the same steps everywhere, batches sized by speed) "
        "or per-device (the same batch everywhere, a faster device takes more inner steps per exchange)",
    )
    p.add_argument("--ps-shards", type=_positive_int, help="ps, ps-async: parameter-server actors (default: by size)")


def _worker_flags(p: argparse.ArgumentParser) -> None:
    """Which workers, where, and the data order: shared by `train`, `plan` and `run`."""
    p.add_argument(
        "--workers",
        type=_workers,
        **_field("workers"),
        help="auto (the default: one worker per GPU in the cluster, and one CPU worker holding every core on a "
        "node without a GPU), a number of CPU workers, or groups such as cuda:1,mps:1,cpu:2",
    )
    p.add_argument(
        "--cpus-per-worker",
        type=_positive,
        **_field("cpus_per_worker"),
        help="Ray CPUs reserved per worker (default %(default)g)",
    )
    p.add_argument(
        "--shares",
        type=_shares,
        **_field("shares"),
        help="auto (default: follow measured speed), equal (fixed equal split), or samples per worker, e.g. 40,24",
    )
    p.add_argument(
        "--seed", type=_seed, **_field("seed"), help="seed for initialisation and sample order (default %(default)s)"
    )
    p.add_argument("--address", type=_text, help="Ray cluster address (default: an embedded local Ray)")
    p.add_argument("--backend", **_field("backend"), help="collective backend (default %(default)s)")
    p.add_argument("--interface", type=_text, help="network interface for the collectives on every node (e.g. eth0)")


def _add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="start, join, inspect or stop a cluster of your machines")
    verbs = cluster.add_subparsers(dest="verb", required=True)

    def node_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--interface", type=_text, help="network interface other machines reach this one on (e.g. en0, eth0)"
        )
        p.add_argument("--node-ip", help="this node's LAN address (instead of --interface)")
        p.add_argument("--num-cpus", type=_positive_int, help="CPUs this node offers (default: all)")
        p.add_argument("--temp-dir", help="Ray's temporary folder on this node (default /tmp/ray)")

    up = verbs.add_parser(
        "up",
        help="start the head node here (token authentication, proven before it returns)",
        description="Start the head node here with token authentication on (the head must refuse a call without "
        "the token, or it is stopped again), without the Ray Client server, the dashboard or metrics export. The "
        "token is kept in $MIXTRAIN_HOME/auth_token (mode 0600) and never printed. Ray sends it unencrypted: on a "
        "network you do not trust, use a WireGuard/Tailscale interface (--interface) or Ray's TLS.",
    )
    up.add_argument("--port", type=_positive_int, default=6379, help="the head's port (default 6379)")
    up.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too, on 127.0.0.1 only")
    node_flags(up)
    join = verbs.add_parser(
        "join",
        help="join this machine to a head",
        description="Join this machine to the head at ADDRESS. Give the head's token file with --token-file PATH "
        "(or --token-file - to read it from standard input); without either, the token this machine keeps is "
        "used, or asked for without echo.",
    )
    join.add_argument("address", help="HOST:PORT that `mixtrain cluster up` printed")
    join.add_argument("--token-file", metavar="PATH", help="the head's auth_token file; '-' reads standard input")
    join.add_argument(
        "--token", help="the token itself (visible to every user in the process list and kept in shell history)"
    )
    node_flags(join)
    status = verbs.add_parser("status", help="every node with its devices and versions")
    status.add_argument("--address", help="HOST:PORT of the head (default: this machine's cluster)")
    verbs.add_parser("down", help="stop the Ray processes that up/join started on this machine")


def _workers(text: str) -> int | str | list:
    from mixtrain.config import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metric_mode(text: str, flag: str) -> tuple[str, str, list[str]]:
    """METRIC[:min|max][:...] -> (metric, mode, the rest). The mode defaults to min for a loss, else max."""
    parts = text.split(":")
    metric = parts[0].strip()
    if not metric or "\0" in metric:  # (a NUL byte: no metric's name; EarlyStopping would refuse it without the flag)
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: name a held-out metric first, e.g. loss or accuracy:max")
    rest = parts[1:]
    if rest and rest[0] in ("min", "max"):
        return metric, rest[0], rest[1:]
    return metric, "min" if "loss" in metric else "max", rest


def _keep_best(text: str) -> tuple[str, str]:
    metric, mode, rest = _metric_mode(text, "--keep-best")
    if rest:
        raise argparse.ArgumentTypeError(f"--keep-best {text!r}: give METRIC or METRIC:min / METRIC:max")
    return metric, mode


def _early_stopping(text: str) -> tuple[str, str, int]:
    metric, mode, rest = _metric_mode(text, "--early-stopping")
    if len(rest) > 1 or (rest and not rest[0].isdigit()) or (rest and int(rest[0]) < 1):
        raise argparse.ArgumentTypeError(
            f"--early-stopping {text!r}: give METRIC[:min|max][:PATIENCE], PATIENCE an integer >= 1, e.g. loss:min:3"
        )
    return metric, mode, int(rest[0]) if rest else 3


def _task(args: argparse.Namespace) -> tuple[str, str]:
    """(target, the flag it came from)."""
    if args.task and args.example and args.task != args.example:
        raise InputValueError(f"TASK {args.task!r} and --example {args.example!r} disagree: give one of them")
    if args.example:
        return args.example, "--example"
    return args.task or "digits", "TASK"


def _trainer(
    args: argparse.Namespace, run_dir: str | None = None, steps_per_round: int | None = None
) -> tuple[Job, Trainer]:
    """The job the flags name, and its Trainer: each flag in FLAG_FIELDS goes to its config field as it is; the
    rest say more than one field (--workers: a count or groups) or the opposite of one (--keep-all-devices)."""
    from mixtrain.cluster.headnode import use_cluster_token
    from mixtrain.job import load_job

    if args.address:
        use_cluster_token(args.address)
    given = {
        c: {f: getattr(args, d) for d, (k, f) in FLAG_FIELDS.items() if k is c and hasattr(args, d)} for c in _CONFIGS
    }
    counted = isinstance(args.workers, int)
    micro = args.max_micro_batch
    if micro is not None and len(micro) == 1 and counted:
        micro = micro * args.workers  # one value for every worker
    callbacks = _callbacks(args)  # a logger's missing library: said now, before the job loads and Ray starts
    target, flag = _task(args)
    job = load_job(target, lr=args.lr, seed=args.seed, data_dir=args.data_dir, args=args.job_args, flag=flag)
    scaling = {
        **given[ScalingConfig],
        "num_workers": args.workers if counted else ScalingConfig.num_workers,
        "groups": None if counted else args.workers,
        "max_micro_batch": micro,
        "leave_out_slow": not args.keep_all_devices,
        "shard": args.shard or ("optimizer" if args.shard_optimizer else "none"),
        "offload": args.offload,
        "address": args.address,
        "network_interface": args.interface,
    }
    run = {
        **given[RunConfig],
        "run_dir": run_dir,
        "steps_per_round": steps_per_round,
        "progress": not getattr(args, "quiet", True),
        "plan_tables": getattr(args, "plan_tables", False),
        "tensorboard": True if getattr(args, "tensorboard", False) else None,
        "max_steps": getattr(args, "max_steps", None),
        "eval_every": getattr(args, "eval_every", None),
        "keep_best": getattr(args, "keep_best", None),
    }
    strategy = {**given[StrategyConfig], "overlap": args.overlap, "ps_shards": args.ps_shards or "auto"}
    return job, job.trainer(
        args.global_batch,
        scaling=ScalingConfig(**scaling),
        strategy=StrategyConfig(**strategy),
        run=RunConfig(**run),
        callbacks=callbacks,
    )


def _callbacks(args: argparse.Namespace) -> list[Any]:
    """The callbacks the flags ask for: --early-stopping, then each --logger once (a resumed run's saved flags
    and the ones given again would name it twice)."""
    from mixtrain.callbacks import EarlyStopping
    from mixtrain.loggers import by_name

    out: list[Any] = []
    if getattr(args, "early_stopping", None):
        metric, mode, patience = args.early_stopping
        out.append(EarlyStopping(metric, mode, patience))
    out += [by_name(name) for name in dict.fromkeys(getattr(args, "logger", None) or [])]
    return out


_CONFIGS = (ScalingConfig, RunConfig, StrategyConfig)


def _resumed(raw: list[str], given: argparse.Namespace) -> tuple[argparse.Namespace, dict[str, Any]]:
    """`train --resume RUN_DIR [flags]`: the run's saved config keys, then its saved flags, then the flags given
    now (later ones win), with what only this command line may say taken from it alone (saved_command.py)."""
    from mixtrain.cli.config_file import apply_values

    resume = given.resume
    _check_holds_run(resume, given.run_dir)
    saved = read_command(resume)
    if saved is None:  # a run started from Python or by hand: the flags given now are all there is
        return given, {}
    where = Path(resume) / COMMAND_FILE
    if given.task or given.example or (given.config and given.config != saved.legacy_config):
        raise InputValueError(
            f"--resume {resume!r} continues the run's own job ({where} holds its flags); leave out TASK, --example "
            "and --config (other flags given now override the saved ones)"
        )
    config, job_args = saved.config, saved.job_args
    if saved.legacy_config is not None:  # a config file's path, saved before 0.3: read again only if given now
        if given.config is None:
            raise redirect_error(resume, "--config", saved.legacy_config)
        from mixtrain.cli.config_file import read_config, split_config

        config, job_args = split_config(read_config(given.config), given.config)
    parser = build_parser()
    apply_values(_subparser(parser, "train"), config, where, _other_flags(parser, "train"))
    _Parser.reading = str(where)
    try:
        before = parser.parse_args(["train", *saved.argv])
    finally:
        _Parser.reading = None
    args = parser.parse_args(["train", *saved.argv, *raw[1:]])
    for dest, flag in REDIRECTS.items():
        if getattr(before, dest) is not None and getattr(given, dest) is None:
            raise redirect_error(resume, flag, getattr(before, dest))
    for dest in (*REDIRECTS, *NOW_ONLY):
        setattr(args, dest, getattr(given, dest))
    args.config = given.config
    return args, {"config": config, "job_args": job_args}


def _check_holds_run(resume: str, run_dir: str | None) -> None:
    """One folder, one run: --resume continues in its own folder (never writes into another run's), and a folder
    that holds no checkpoint is bad input, not a job that failed."""
    from mixtrain.checkpoint import MANIFEST

    if not Path(resume).is_dir():
        raise InputValueError(f"--resume {resume!r}: no such run folder")
    if run_dir is not None and Path(run_dir).absolute() != Path(resume).absolute():
        raise InputValueError(
            f"--resume {resume!r} --run-dir {run_dir!r}: a resumed run continues in its own folder (writing into "
            f"another would mix two runs' checkpoints and metrics); leave out --run-dir, or copy {resume} there first"
        )
    if not (Path(resume) / MANIFEST).is_file() and not (Path(resume) / "checkpoints").is_dir():
        raise InputValueError(
            f"--resume {resume!r}: that folder holds no run (no checkpoints/ in it); give the folder a run wrote "
            "(the 'run folder:' line it printed), or start a new run"
        )


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
        args, saved = _resumed(raw, args)
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
    apply_values(_subparser(parser, args.command), data, config, _other_flags(parser, args.command))
    args = parser.parse_args(raw)
    args.job_args, args.config_data = job_args, data
    return args, raw


def _other_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The other subcommand's flags: a config file for `train` may be used to `plan`, and the reverse."""
    other = "plan" if command == "train" else "train"
    return {a.dest for a in _subparser(parser, other)._actions}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _check_resumed_job(args: argparse.Namespace) -> None:
    """Resuming imports and runs the job function the run folder names, with its arguments and flags. Refuse a
    record this user's key did not sign (a folder from elsewhere, or edited), or a module:function whose module
    would now come from another file than the one the run recorded (one that moved, or a module of the same name
    planted in this folder), unless --trust-job was given now. Nothing of the job is imported before this."""
    from mixtrain.job import module_file

    saved = read_command(args.resume)
    if saved is None or args.trust_job:  # no record: the job and the flags are this command line's alone
        return
    target = _task(args)[0]
    here = module_file(target)
    where = Path(args.resume) / COMMAND_FILE
    if not saved.signed:
        raise InputValueError(
            f"--resume {args.resume!r}: {where} is not signed with your key (unsigned, edited, or written by another "
            f"user or machine), and a resume runs what it names: it would {_what_runs(saved, target, here)}. Check "
            "that, then add --trust-job to run it"
        )
    if ":" in target and (saved.job_file is None or here is None or Path(here) != Path(saved.job_file)):
        raise InputValueError(
            f"--resume {args.resume!r} would import and run {target} from {here or 'nowhere (not found)'}, but the run "
            f"started with {saved.job_file or 'no recorded file'}; resuming runs the job code the folder names. Check "
            f"{where} and that file, then add --trust-job to run it"
        )


def _what_runs(saved: SavedCommand, target: str, here: str | None) -> str:
    """What a resume would run, in words, for the line that asks for --trust-job."""
    call = ", ".join(f"{k}={v!r}" for k, v in saved.job_args.items())
    job = f"train {target}"
    if ":" in target:
        job = f"import and run {target}({call}) from {here or 'nowhere (not found)'}"
    flags = " ".join(saved.argv) or "none"
    config = f", config {json.dumps(saved.config)}" if saved.config else ""
    return f"{job} with the flags {flags}{config}"[:600]


def cmd_train(args: argparse.Namespace, raw: list[str]) -> int:

    from mixtrain.callbacks import EVAL_KEYS
    from mixtrain.observe.runlog import check_new_run_dir, new_run_name

    run_dir = Path(args.run_dir or args.resume or Path("mixtrain_runs") / new_run_name())
    if args.resume:
        _check_resumed_job(args)  # before the job's module is imported
    elif args.trust_job:
        raise InputValueError("--trust-job goes with --resume RUN_DIR")
    else:
        check_new_run_dir(run_dir)  # before command.json is written there
    job, trainer = _trainer(args, str(run_dir), args.steps_per_round)  # checks the flags first
    if not args.resume:
        save_command(raw, run_dir, _task(args)[0], args.config_data, args.job_args)
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


def cmd_plan(args: argparse.Namespace) -> int:
    from mixtrain.observe.progress import plan_table

    if args.devices is not None:
        from mixtrain.cli.what_if import cmd_what_if

        return cmd_what_if(args, *_task(args))
    if args.link is not None or args.blocks is not None:
        raise InputValueError("--link and --blocks go with --devices (the what-if plan); give --devices too")
    _, trainer = _trainer(args)
    up = trainer.plan()
    print(f"{_task(args)[0]}: global batch {trainer.global_batch}, {up.backend}")
    print(plan_table(up.plan, up.workers, "plan", up.left_out))
    print(up.strategy_line())
    for note in up.notes:
        print(note)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from mixtrain.cli.run import cmd_run

    return cmd_run(args)


def cmd_devices(args: argparse.Namespace) -> int:
    import socket

    from mixtrain import compat, devices
    from mixtrain.cluster.headnode import format_devices

    v = compat.versions()
    print(f"{socket.gethostname()}: python {v['python']}, torch {v['torch']}, ray {v['ray']}, mixtrain {v['mixtrain']}")
    print("\n".join(format_devices([d.as_dict() for d in devices.local_devices()])))
    return 0


def _up_message(state: NodeState, token: Path, tls: bool = False) -> str:
    """What `cluster up` prints: where the token is and join commands that keep it off every command line."""
    wire = "Ray's TLS is on, so it travels encrypted" if tls else "Ray sends it unencrypted (docs/security.md)"
    return "\n".join(
        [
            f"head running at {state.address} (log: {state.log})",
            f"token authentication is on (a call without the token was refused); the token is in {token}",
            f"(mode 0600). It opens every machine of the cluster, and {wire}.",
            "on each other machine, with the same Python, torch and mixtrain versions, copy that file over and run:",
            f"  mixtrain cluster join {state.address} --token-file auth_token",
            "or pipe it, so it is written nowhere on the way:",
            f"  ssh {state.node_ip} cat {token} | mixtrain cluster join {state.address} --token-file -",
            "then train from this machine with:",
            f"  mixtrain train --address {state.address} --workers auto",
        ]
    )


def cmd_cluster(args: argparse.Namespace) -> int:
    from mixtrain.cluster import headnode

    if args.verb == "up":
        import platform

        state = headnode.up(
            port=args.port,
            interface=args.interface,
            node_ip=args.node_ip,
            num_cpus=args.num_cpus,
            temp_dir=args.temp_dir,
            dashboard=args.dashboard,
        )
        from mixtrain.cluster.auth import tls_on

        print(_up_message(state, headnode.token_path(), tls_on()))
        if platform.system() == "Darwin":
            print(headnode.MAC_HEAD_ADVICE)
        return 0
    if args.verb == "join":
        from mixtrain.cluster.auth import read_token_arg

        state = headnode.join(
            args.address,
            token=read_token_arg(args.token, args.token_file, sys.stdin),
            interface=args.interface,
            node_ip=args.node_ip,
            num_cpus=args.num_cpus,
            temp_dir=args.temp_dir,
        )
        print(f"joined {state.address} as {state.node_ip} (log: {state.log}); leave with `mixtrain cluster down`")
        return 0
    if args.verb == "status":
        current = headnode.load_state()
        address = args.address or (current.address if current else None)
        if address is None:
            raise InputValueError(
                "cluster status: no --address and this machine has no cluster; run `mixtrain cluster up`"
            )
        headnode.use_cluster_token(address)
        print(headnode.format_status(headnode.status(address)))
        return 0
    gone = headnode.down()
    if gone is None:
        print("no mixtrain cluster runs here")
    elif gone[1] is None:
        print(f"stopped the Ray {gone[0].role} for {gone[0].address}")
    else:
        print(f"nothing to stop: the Ray {gone[0].role} for {gone[0].address} is gone ({gone[1]}); record removed")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from mixtrain.cli import envinfo

    report = envinfo.bug_report()
    print(json.dumps(report, indent=2) if args.json else envinfo.format_bug_report(report))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from mixtrain.observe.report import write_report

    out = write_report(args.run_dir, args.out)
    print(out.summary)
    for path in out.files:
        print(f"wrote {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mixtrain.pretrained import export_pretrained

    print(f"wrote {export_pretrained(args.path, args.out)}")
    return 0


def _version() -> str:
    from mixtrain import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "plan": cmd_plan,
        "run": _cmd_run,
        "devices": cmd_devices,
        "cluster": cmd_cluster,
        "env": cmd_env,
        "report": cmd_report,
        "export": cmd_export,
    }
    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # a caller's own (tests): theirs
    try:
        args, raw = _parse(raw)
        if args.command == "train":
            return cmd_train(args, raw)
        return commands[args.command](args)
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
