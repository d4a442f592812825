"""Local SGD's outer optimizer: the summed, weighted deltas (the pseudo-gradient) applied to the common point with
SGD and Nesterov momentum, as torch.optim.SGD computes it (by default lr 1 and no momentum: plain averaging);
and, for plain averaging, the same exchange in pieces of one bucket, through one small buffer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from mixtrain.comm import replicas
from mixtrain.comm.delta_wire import DeltaWire
from mixtrain.comm.strategy import StepResult


def finite(delta: torch.Tensor) -> bool:
    """No NaN or Inf in `delta`, by its sum first (no temporary as large as it unless the sum is not finite)."""
    return bool(torch.isfinite(delta.sum())) or bool(torch.isfinite(delta).all())


def outer_step(anchor: torch.Tensor, delta: torch.Tensor, momentum: torch.Tensor, lr: float, mu: float) -> bool:
    """Move the common point `anchor` by the summed `delta` (changed in place), unless it is not finite."""
    if not finite(delta):
        return False
    if mu:
        momentum.mul_(mu).add_(delta)
        delta.add_(momentum, alpha=mu)
    anchor.sub_(delta, alpha=lr)  # (without momentum: SGD's own update)
    return True


def step_results(stats: torch.Tensor, applied: bool) -> list[StepResult]:
    """One result per step of the window from its summed statistics (the last: how many ranks skipped it)."""
    return [StepResult(applied and float(s[-1]) == 0.0, s[:-1]) for s in stats]


def average_in_pieces(
    params: Sequence[torch.Tensor],
    anchor: torch.Tensor,
    work: torch.Tensor,
    pending: torch.Tensor,
    share: float,
    piece: int,
    wire: DeltaWire,
    lr: float,
) -> tuple[list[StepResult], int]:
    """The exchange (plain averaging: no outer momentum) in pieces of `piece` values of the flat weights, in order,
    through the one small buffer `work`: the statistics (`pending`, k steps by 2) travel with the first piece; each
    piece's average moves that part of the WEIGHTS to the new common point, and the common point itself (`anchor`)
    takes the weights only once every piece has landed. A peer lost part-way leaves the anchor as it was, and recover()
    puts the weights back to it, as with one collective. Every rank sees the same sums, so a non-finite one stops
    every rank at the same piece, nobody applies the exchange, and the weights go back to the anchor."""
    n, k = anchor.numel(), pending.shape[0]
    applied, sent, stats = True, 0, torch.zeros(k, 2)
    for start in range(0, max(n, 1), piece):
        stop, head = min(n, start + piece), 2 * k if start == 0 else 0
        buf = work[: head + stop - start]
        if head:
            buf[:head].copy_(pending.reshape(-1))
        delta = buf[head:].copy_(anchor[start:stop])
        subtract_weights(params, delta, start, stop)
        delta.mul_(share)
        _, sum_, nbytes = wire.launch(buf, buf.numel(), async_op=False)
        sent += nbytes
        if sum_ is not buf:
            buf.copy_(sum_)
        if head:
            stats = buf[:head].view(k, 2).clone()
        if not finite(delta):
            applied = False
            break
        torch.sub(anchor[start:stop], delta, alpha=lr, out=delta)  # in place: no temporary
        with torch.no_grad():
            for weights, at in weight_pieces(params, start, stop):
                weights.copy_(delta[at : at + weights.numel()])
    if applied:
        for weights, at in weight_pieces(params, 0, n):
            anchor[at : at + weights.numel()].copy_(weights.to("cpu"))
    else:
        replicas.unflatten_into(anchor, params)
    return step_results(stats, applied), sent


def subtract_weights(params: Sequence[torch.Tensor], delta: torch.Tensor, start: int, stop: int) -> None:
    """delta -= the weights at flat positions [start, stop), one parameter at a time (no temporary as large as
    the model)."""
    for weights, at in weight_pieces(params, start, stop):
        delta[at : at + weights.numel()].sub_(weights.to("cpu", torch.float32))


def weight_pieces(params: Sequence[torch.Tensor], start: int, stop: int) -> Iterator[tuple[torch.Tensor, int]]:
    """The parts of the weights at flat positions [start, stop): (that part, where it begins relative to `start`).
    A view of the parameter when it is contiguous (always, where the pieces are written into)."""
    offset = 0
    for p in params:
        lo, hi = max(start, offset), min(stop, offset + p.numel())
        if lo < hi:
            yield p.detach().reshape(-1)[lo - offset : hi - offset], lo - start
        offset += p.numel()
        if offset >= stop:
            return
