"""What a replica reports once built (TrainWorker.build), for the preflight to compare across workers: its
device, precision, the model's signature, tensors and shape, versions; or the problem that stops it here."""

from __future__ import annotations

from dataclasses import replace

import torch

from mixtrain import compat, frozen_base, pretrained
from mixtrain.devices import DeviceInfo, DeviceKind
from mixtrain.policies import model_shape
from mixtrain.records.messages import BuildReport
from mixtrain.shard.blocks import block_name
from mixtrain.task import Task


def float64_problem(model: torch.nn.Module, kind: DeviceKind) -> str:
    """Why the model cannot go to a device of `kind` that has no float64 ("" when it can)."""
    if kind.supports_float64:
        return ""
    wide = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.dtype == torch.float64]
    if wide:
        return f"float64 tensors {wide[:3]} cannot go to {kind.kind}; build the model in float32"
    return ""


def built(who: BuildReport, task: Task, info: DeviceInfo, precision: str) -> BuildReport:
    """`who` (rank, host, request, versions) with the replica of `task` built on the device `info` describes.

    The frozen base's fingerprint and the state's shape are the reference worker's (rank 0 at the start) alone:
    the driver reads them from there (the join makes every replica rank 0's bytes, frozen weights included), and
    the fingerprint hashes the whole frozen base (seconds for a 1B base on every worker otherwise)."""
    model = task.model
    reference = who.rank == 0
    block = block_name(task.shard_blocks)
    return replace(
        who,
        device=info,
        precision=precision,
        signature=compat.model_signature(model),
        tensors=tuple(
            (n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in (*model.named_parameters(), *model.named_buffers())
        ),
        num_params=sum(p.numel() for p in model.parameters()),
        # what one exchange of the gradients moves (in fp32 whatever the weights' dtype); ModelShape.trainable_bytes
        # is what the weights hold
        trainable_bytes=sum(p.numel() * 4 for p in model.parameters() if p.requires_grad),
        nccl=torch.distributed.is_nccl_available(),
        max_grad_norm=task.max_grad_norm,
        hf_model=pretrained.spec_of(model),
        frozen=frozen_base.describe(model) if reference else None,
        shape=model_shape.state_shape(model, task.optimizer, block=block) if reference else None,
    )
