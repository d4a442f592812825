"""The job and the Trainer that the flags of `train` and `plan` name."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from mixtrain.cli.flags import FLAG_FIELDS
from mixtrain.config import LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig
from mixtrain.errors import InputValueError

if TYPE_CHECKING:  # the CLI imports torch and Ray only for the commands that need them
    from mixtrain.job import Job
    from mixtrain.trainer import Trainer

CONFIGS = (ScalingConfig, RunConfig, StrategyConfig, PSConfig, LocalSGDConfig)


def task(args: argparse.Namespace) -> tuple[str, str]:
    """(target, the flag it came from)."""
    if args.task and args.example and args.task != args.example:
        raise InputValueError(f"TASK {args.task!r} and --example {args.example!r} disagree: give one of them")
    if args.example:
        return args.example, "--example"
    return args.task or "digits", "TASK"


def trainer(
    args: argparse.Namespace, run_dir: str | None = None, steps_per_round: int | None = None
) -> tuple[Job, Trainer]:
    """The job the flags name, and its Trainer: each flag in FLAG_FIELDS goes to its config field as it is; the
    rest say more than one field (--workers: a count or groups) or the opposite of one (--keep-all-devices)."""
    from mixtrain.cluster.headnode import use_cluster_token
    from mixtrain.job import load_job

    if args.address:
        use_cluster_token(args.address)
    given = {
        c: {f: getattr(args, d) for d, (k, f) in FLAG_FIELDS.items() if k is c and hasattr(args, d)} for c in CONFIGS
    }
    counted = isinstance(args.workers, int)
    micro = args.max_micro_batch
    if micro is not None and len(micro) == 1 and counted:
        micro = micro * args.workers  # one value for every worker
    chosen = callbacks(args)  # a logger's missing library: said now, before the job loads and Ray starts
    target, flag = task(args)
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
    ps = PSConfig(**given[PSConfig], shards=args.ps_shards or "auto")
    local_sgd = LocalSGDConfig(**given[LocalSGDConfig], overlap=args.overlap)
    return job, job.trainer(
        args.global_batch,
        scaling=ScalingConfig(**scaling),
        strategy=StrategyConfig(**given[StrategyConfig], ps=ps, local_sgd=local_sgd),
        run=RunConfig(**run),
        callbacks=chosen,
    )


def callbacks(args: argparse.Namespace) -> list[Any]:
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
