"""Gradients summed onto their owners: as a block's backward ends, a reduce per owner of its gradients; every
other rank drops them. And the step's one all-reduce: the statistics and each owner's part of the global norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mixtrain.comm import replicas
from mixtrain.shard.units import CommClock, Unit


class GradReduce:
    """This rank's reduces onto the owners, and the sums it receives as an owner (over a step's passes)."""

    def __init__(self, rank: int, clock: CommClock, release: Callable[[Unit], None]) -> None:
        self.rank = rank
        self.clock = clock
        self.release = release
        """Frees a unit's weights once its gradients are gone (WeightGather.release)."""
        self.acc: dict[int, torch.Tensor] = {}
        """id(owned parameter) -> the sum over ranks of its gradient, over the step's passes so far."""

    def reduce(self, unit: Unit) -> None:
        """Each owner receives the sum over ranks of its parameters' gradients in `unit` (zeros for a parameter
        this rank's pass did not reach); every other rank drops them. Then the unit's weights are freed."""
        unit.backward = False
        unit.waiting = set()
        with self.clock.timed():
            for owner, _, params in unit.groups:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = replicas.flat_on_host(grads, torch.float32)
                dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM)
                self.clock.sent += flat.numel() * flat.element_size()
                if owner == self.rank:
                    self._accumulate(params, flat)
                for p in params:
                    p.grad = None
        self.release(unit)

    def _accumulate(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            part = flat[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
            offset += n
            if id(p) in self.acc:
                self.acc[id(p)].add_(part)
            else:  # (a view into `flat`, which holds only this owner's gradients)
                self.acc[id(p)] = part

    def to_owners(self, units: list[Unit], owned: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The passes are over: what has not gone to its owner yet (the root's gradients, summed over the passes;
        a block some parameter of which no pass reached) goes now, and (the root's weights freed) each owned
        parameter's .grad becomes the sum over ranks; every other .grad is None. Returns `owned`."""
        for unit in units[1:]:
            if unit.backward:
                self.reduce(unit)
        self.reduce(units[0])
        for p in owned:
            p.grad = self.acc.pop(id(p), None)
        return owned

    def sum_stats_and_squares(self, local_stats: torch.Tensor, owned: list[torch.nn.Parameter]) -> torch.Tensor:
        """One all-reduce: the step's statistics summed over ranks, then the sum of the squared gradient (each
        owner's part of the global norm), in float64 (a NaN or Inf anywhere makes it non-finite)."""
        with self.clock.timed():
            squares = [torch.sum(p.grad.detach().double() ** 2) for p in owned if p.grad is not None]
            sumsq = float(torch.stack(squares).sum()) if squares else 0.0
            stats = local_stats.detach().to("cpu", torch.float64).reshape(-1)
            summed = torch.cat([stats, torch.tensor([sumsq], dtype=torch.float64)])
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
