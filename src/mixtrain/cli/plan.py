"""`mixtrain plan`: the split the workers would train with, or (--devices) what fits on devices named only."""

from __future__ import annotations

import argparse
from typing import Any

from mixtrain.cli import from_flags
from mixtrain.cli.flag_types import _positive_int
from mixtrain.cli.flags import job_flags
from mixtrain.errors import InputValueError


def add_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="measure every device and show how the batch would be split, without training",
        description="Start the workers, measure each device's speed and memory and the communication, "
        "print the plan (share, micro-batch x accumulation, predicted samples/s, memory cap, devices left out "
        "and why), and stop.",
    )
    job_flags(plan)
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


def cmd_plan(args: argparse.Namespace) -> int:
    from mixtrain.observe.progress import plan_table

    if args.devices is not None:
        from mixtrain.cli.what_if import cmd_what_if

        return cmd_what_if(args, *from_flags.task(args))
    if args.link is not None or args.blocks is not None:
        raise InputValueError("--link and --blocks go with --devices (the what-if plan); give --devices too")
    _, trainer = from_flags.trainer(args)
    up = trainer.plan()
    print(f"{from_flags.task(args)[0]}: global batch {trainer.global_batch}, {up.backend}")
    print(plan_table(up.plan, up.workers, "plan", up.left_out))
    print(up.strategy_line())
    for note in up.notes:
        print(note)
    return 0
