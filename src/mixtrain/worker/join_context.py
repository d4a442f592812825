"""What a replica's strategy is told when it is set up on a newly formed group (TrainWorker.join): the request's
settings, this rank's place, and how much of a sharded optimizer's state each rank holds."""

from __future__ import annotations

import torch

from mixtrain.comm.strategy import JoinContext
from mixtrain.devices import DeviceKind
from mixtrain.records.messages import JoinRequest


def join_context(
    request: JoinRequest, rank: int, world_size: int, kind: DeviceKind, device: torch.device
) -> JoinContext:
    """The strategy's settings on the group that `request` formed, for `rank` of `world_size` on `device`."""
    return JoinContext(
        bucket_bytes=request.bucket_bytes,
        loss_scaling=request.loss_scaling,
        rank=rank,
        world_size=world_size,
        timeout_s=request.collective_timeout_s,
        servers=tuple(request.servers),
        fresh_state=request.fresh_state,
        shard_weights=shard_weights(request.shard_optimizer, world_size, kind, device),
        offload=request.offload,
        store_pages_bytes=request.store_pages_bytes,
    )


def shard_weights(
    requested: tuple[float, ...] | None, world_size: int, kind: DeviceKind, device: torch.device
) -> tuple[float, ...] | None:
    """Per rank, how much optimizer state to hold: the user's figures, or (an empty tuple) every rank's
    free memory, gathered here. None: the optimizer is not sharded."""
    if requested is None or requested:
        return requested
    free = kind.memory(device.index or 0)[1]
    mine = torch.tensor([float(free or 0)], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, mine)
    weights = tuple(float(t) for t in everyone)
    return weights if all(w > 0 for w in weights) else (1.0,) * world_size  # unknown: equal slices
