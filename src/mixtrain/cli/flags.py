"""Flags shared by several subcommands, one function per group and the config section it fills: the workers
(`train`, `plan`, `run`), then what a job is made of (`train`, `plan`): the task, the batch, memory and numerics
(ScalingConfig), the strategy (StrategyConfig, with its PSConfig and LocalSGDConfig sections)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from mixtrain.cli.flag_types import (
    _micro_batches,
    _non_negative_int,
    _number,
    _positive,
    _positive_int,
    _seed,
    _shares,
    _text,
    _workers,
)
from mixtrain.config import LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig

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
    "staleness": (PSConfig, "staleness"),
    "local_steps": (LocalSGDConfig, "local_steps"),
    "outer_lr": (LocalSGDConfig, "outer_lr"),
    "outer_momentum": (LocalSGDConfig, "outer_momentum"),
    "pace": (LocalSGDConfig, "pace"),
}
"""Flags whose default (and, for a field that takes a fixed set of names, whose choices) is the config field's own:
a default is written once, in config.py, and help texts show it through argparse's %(default)s."""


def from_config(dest: str) -> dict[str, Any]:
    """add_argument's default= (and choices=) for the flag `dest`, from its config field."""
    cls, name = FLAG_FIELDS[dest]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    out: dict[str, Any] = {"default": field.default}
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is typing.Literal:
        out["choices"] = typing.get_args(hint)
    return out


def job_flags(p: argparse.ArgumentParser) -> None:
    """What a job is made of: shared by `train` and `plan`."""
    task_flags(p)
    worker_flags(p)
    scaling_flags(p)
    strategy_flags(p)


def task_flags(p: argparse.ArgumentParser) -> None:
    """Which job: a built-in example, a job function or a config file, and its data."""
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


def worker_flags(p: argparse.ArgumentParser) -> None:
    """Which workers, where, and the data order: shared by `train`, `plan` and `run`."""
    p.add_argument(
        "--workers",
        type=_workers,
        **from_config("workers"),
        help="auto (the default: one worker per GPU in the cluster, and one CPU worker holding every core on a "
        "node without a GPU), a number of CPU workers, or groups such as cuda:1,mps:1,cpu:2",
    )
    p.add_argument(
        "--cpus-per-worker",
        type=_positive,
        **from_config("cpus_per_worker"),
        help="Ray CPUs reserved per worker (default %(default)g)",
    )
    p.add_argument(
        "--shares",
        type=_shares,
        **from_config("shares"),
        help="auto (default: follow measured speed), equal (fixed equal split), or samples per worker, e.g. 40,24",
    )
    p.add_argument(
        "--seed",
        type=_seed,
        **from_config("seed"),
        help="seed for initialisation and sample order (default %(default)s)",
    )
    p.add_argument("--address", type=_text, help="Ray cluster address (default: an embedded local Ray)")
    p.add_argument("--backend", **from_config("backend"), help="collective backend (default %(default)s)")
    p.add_argument("--interface", type=_text, help="network interface for the collectives on every node (e.g. eth0)")


def scaling_flags(p: argparse.ArgumentParser) -> None:
    """The batch, where the training state lives, and each device's numerics (ScalingConfig), with the job's lr."""
    p.add_argument("--global-batch", type=_positive_int, help="samples per step over all workers")
    p.add_argument(
        "--max-micro-batch",
        type=_micro_batches,
        help="largest micro-batch per worker (one number for all, or one per worker, e.g. 64,16); a larger share "
        "is split with gradient accumulation (default: measured on GPUs, no limit on CPUs)",
    )
    p.add_argument(
        "--shard",
        choices=["none", "optimizer", "gradients", "full", "auto"],
        help="slice the training state over the workers by their free memory instead of keeping all of it on each: "
        "optimizer (its state, AdamW: twice the weights), gradients (also the gradients), full (also the weights, "
        "gathered one block at a time), auto (the lowest level whose state fits every worker, chosen at start): "
        "larger models fit, the same math (allreduce only; default none)",
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
        **from_config("precision"),
        help="fp32 (default, exact) or auto: bf16/fp16 autocast on GPUs, fp32 on CPUs",
    )
    p.add_argument(
        "--numerics",
        **from_config("numerics"),
        help="start-up gradient check of each device against the CPU: warn, strict (leave bad devices out), off",
    )


def strategy_flags(p: argparse.ArgumentParser) -> None:
    """How the workers agree on the weights (StrategyConfig)."""
    p.add_argument(
        "--strategy",
        **from_config("strategy"),
        help="allreduce (default: gradients summed every step), ps (parameter servers, the same math), "
        "ps-async (parameter servers, workers up to --staleness updates ahead), local-sgd (average every "
        "--local-steps steps, DiLoCo outer step), auto (measure the link at start-up and pick allreduce, or "
        "local-sgd with H and compression)",
    )
    p.add_argument(
        "--compress",
        **from_config("compress"),
        help="send gradients (allreduce, ps) or deltas (local-sgd) as bf16 or fp16 (default %(default)s: fp32); "
        "local-sgd also int8 or int4 (per-block scales, error feedback)",
    )
    p.add_argument(
        "--staleness",
        type=_non_negative_int,
        **from_config("staleness"),
        help="ps-async: updates a worker may run ahead (default %(default)s; 0: synchronous)",
    )
    local_sgd_flags(p)
    p.add_argument("--ps-shards", type=_positive_int, help="ps, ps-async: parameter-server actors (default: by size)")


def local_sgd_flags(p: argparse.ArgumentParser) -> None:
    """local-sgd's own: how often the workers average, the outer step, and the pace of unequal devices."""
    p.add_argument(
        "--local-steps",
        type=_positive_int,
        **from_config("local_steps"),
        help="local-sgd: steps between averages (default %(default)s)",
    )
    p.add_argument(
        "--outer-lr",
        type=_positive,
        **from_config("outer_lr"),
        help="local-sgd: learning rate of the outer step on the averaged delta (default %(default)s: plain averaging)",
    )
    p.add_argument(
        "--outer-momentum",
        type=_number(0, below=1),
        **from_config("outer_momentum"),
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
        **from_config("pace"),
        help="local-sgd on unequal devices: balanced (default: the same steps everywhere, batches sized by speed) "
        "or per-device (the same batch everywhere, a faster device takes more inner steps per exchange)",
    )
