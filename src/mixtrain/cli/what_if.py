"""`mixtrain plan JOB --devices cuda:12GB,mps:16GB --link 1gbit`: what fits where, for hardware one may not have.

The job's model is built here, on this machine's CPU, and measured (weights, optimizer state after one step of a
copy, activations of two micro-batches of the job's own data, FLOPs); the devices are only named. Neither Ray nor a
worker starts. `--blocks N` predicts the same shape with N repeated blocks (a 1B-parameter GPT-2 from a 2-layer
one) instead of the job's own.
"""

from __future__ import annotations

import argparse

from mixtrain.errors import InputValueError

DEFAULT_LINK = "1gbit"
MICRO_BATCHES = (1, 2)


def cmd_what_if(args: argparse.Namespace, target: str, flag: str) -> int:
    import torch

    from mixtrain.data.sources import describe, make_source
    from mixtrain.job import load_job
    from mixtrain.policies.memory_plan import parse_devices, parse_link, plan_memory
    from mixtrain.policies.model_shape import measure_task
    from mixtrain.task import build_task

    devices = parse_devices(args.devices)  # the flags are checked before the job loads
    link = parse_link(args.link or DEFAULT_LINK)
    job = load_job(target, lr=args.lr, seed=args.seed, data_dir=args.data_dir, args=args.job_args, flag=flag)
    torch.manual_seed(args.seed)
    task = build_task(job.task_factory)
    source = make_source(describe(job.train_data, "train_data"), args.seed)
    try:
        first = source.first(max(MICRO_BATCHES))
        shape = measure_task(task, first.batch, micro_batches=MICRO_BATCHES)
    finally:
        source.close()
    measured = shape.describe()
    if args.blocks is not None:
        if not shape.num_blocks:
            raise InputValueError(f"--blocks {args.blocks}: {target}'s model has no repeated block to scale")
        shape = shape.scaled(args.blocks)
    plan = plan_memory(shape, devices, link, args.global_batch or job.global_batch)
    scaled = f", predicted with {args.blocks} blocks" if args.blocks is not None else ""
    print(f"{target}: measured on this CPU ({measured}{scaled}); no workers started")
    print(plan.table())
    return 0
