"""Keeping replicas identical: initial broadcast, weighted buffer averaging, drift checks."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist


def comm_device() -> torch.device:
    """Where collective buffers live: CPU for gloo (it takes CPU tensors only), the GPU for NCCL."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Move to the CPU first, then convert: a float64 conversion never runs on MPS, which has no float64."""
    return t.detach().to("cpu").to(dtype or t.dtype)


def flat_on_host(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One CPU buffer holding `tensors` back to back (converted to `dtype` when given); empty for none."""
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32)
    return torch.cat([_to_host(t, dtype).reshape(-1) for t in tensors])


def _flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """One buffer on the comm device holding `tensors` back to back."""
    return flat_on_host(tensors, dtype).to(comm_device())


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` into `tensors` (each keeps its own device and dtype)."""
    flat = flat.to("cpu")
    offset = 0
    for t in tensors:
        n = t.numel()
        with torch.no_grad():
            t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n


BROADCAST_CHUNK_BYTES = 16 * 2**20
"""At most this much is flattened for one broadcast: the copy costs memory as long as the model, otherwise."""


def _flat_broadcast(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcast tensors from `src`, flattened per dtype into pieces of at most BROADCAST_CHUNK_BYTES (a
    tensor larger than that travels alone, in place where it already lives on the comm device: no copy)."""
    pieces: list[list[torch.Tensor]] = []
    open_piece: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        group, size = open_piece.get(t.dtype, ([], 0))
        if group and size + t.numel() * t.element_size() > BROADCAST_CHUNK_BYTES:
            pieces.append(group)
            group, size = [], 0
        group.append(t)
        open_piece[t.dtype] = (group, size + t.numel() * t.element_size())
    pieces += [group for group, _ in open_piece.values() if group]
    device = comm_device()
    for group in pieces:
        if len(group) == 1 and group[0].device == device and group[0].is_contiguous():
            with torch.no_grad():
                dist.broadcast(group[0].data, src=src)
            continue
        flat = _flatten(group)
        dist.broadcast(flat, src=src)
        unflatten_into(flat, group)


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int) -> None:
    """Make `tensors` on every rank equal to rank `src`'s, in bounded pieces (see _flat_broadcast)."""
    _flat_broadcast(list(tensors), src)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Optimizer state tensors in a fixed order (parameter order, then key order)."""
    out: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
    return out


def broadcast_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, src: int = 0) -> None:
    """Make every replica equal to rank `src`: parameters, buffers and optimizer state. Nothing travels where
    every replica holds `src`'s bytes already (same_everywhere): replicas built from one seed, or a group
    re-formed between rounds, would otherwise send the whole model again (101 MB: 160 s over 5 Mbit/s)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if optimizer is not None:
        tensors += optimizer_tensors(optimizer)
    if _solo() or same_everywhere(tensors, src):
        return
    _flat_broadcast(tensors, src)


def digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """A 128-bit BLAKE2 hash of the tensors' shapes, dtypes and bytes, in order, a piece at a time on the host:
    equal exactly when the bytes are (-0.0 and 0.0, or two NaN payloads, differ), barring a hash collision."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        flat = t.detach().reshape(-1)
        for piece in flat.split(CHECKSUM_CHUNK):
            # a copy: numpy() on the weight's own storage would make it non-resizable for good (shard="full")
            h.update(piece.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().data)
    return h.digest()


def same_everywhere(tensors: Sequence[torch.Tensor], src: int = 0) -> bool:
    """Whether every rank's `tensors` hold rank `src`'s bytes: every rank's digest goes to all (one all-gather of
    16 bytes each, as drift() gathers checksums), so all take the same answer; every rank must call it."""
    mine = torch.frombuffer(bytearray(digest(tensors)), dtype=torch.uint8).to(comm_device())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(g, gathered[src]) for g in gathered)


def _solo() -> bool:
    """One rank: nothing to average, nobody to drift from."""
    return dist.get_world_size() == 1


def average_buffers(model: torch.nn.Module, weight: float) -> None:
    """Floating-point buffers (BatchNorm running stats) become the `weight`-weighted mean over ranks;
    integer buffers (num_batches_tracked) take rank 0's value."""
    if _solo():
        return
    floats = [b for b in model.buffers() if b.is_floating_point()]
    ints = [b for b in model.buffers() if not b.is_floating_point()]
    if floats:
        flat = _flatten(floats, torch.float64) * weight
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        unflatten_into(flat, floats)
    if ints:
        _flat_broadcast(ints)


CHECKSUM_CHUNK = 1 << 18
"""Elements per piece when fingerprinting: a float64 copy of a whole large weight would cost 2x its memory."""


def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A float64 fingerprint of the tensors: sum and sum of absolute values, a piece at a time."""
    total = torch.zeros(2, dtype=torch.float64)
    for t in tensors:
        for piece in t.detach().reshape(-1).split(CHECKSUM_CHUNK):
            d = _to_host(piece, torch.float64)
            total[0] += d.sum()
            total[1] += d.abs_().sum()
    return total


def drift(model: torch.nn.Module) -> float:
    """Largest relative checksum difference of any rank's parameters from rank 0's."""
    mine = checksum(list(model.parameters())).to(comm_device())
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    ref = gathered[0]
    scale = ref.abs().clamp_min(1e-12)
    return max(float(((g - ref).abs() / scale).max()) for g in gathered)


def resync_if_drifted(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tolerance: float) -> tuple[float, bool]:
    """Compare replicas; re-broadcast rank 0's state when they drifted past `tolerance`.
    Every rank sees the same gathered checksums, so all take the same branch."""
    if _solo():
        return 0.0, False
    d = drift(model)
    if d > tolerance:
        broadcast_state(model, optimizer)
        return d, True
    return d, False
