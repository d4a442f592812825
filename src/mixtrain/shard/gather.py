"""A block's weights gathered from their owners just before it runs and freed after it (shard="full"), the next
block's gather started ahead of its forward (prefetch), in the order the first forward ran the blocks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixtrain.comm import replicas
from mixtrain.shard.units import CommClock, Unit, storage_bytes

Pieces = list[tuple[Any, torch.Tensor, int, list[torch.nn.Parameter]]]
"""One broadcast per owner and dtype of a unit's weights: (work or None, host buffer, owner, parameters)."""


class WeightGather:
    """The gathers and frees of this rank's units; at "gradients" (every rank holds the whole weights) none."""

    def __init__(self, rank: int, full: bool, clock: CommClock) -> None:
        self.rank = rank
        self.full = full
        self.clock = clock
        self.order: list[Unit] = []
        """The blocks in the order the first forward ran them (then: which block to prefetch next)."""
        self.recorded = False
        self.prefetched = 0
        """Blocks whose gather was started ahead of their forward (for tests and profiles)."""
        self._pending: dict[int, Pieces] = {}
        self._flats: dict[int, torch.Tensor] = {}
        """id(a unit's group of another owner's CPU weights) -> the one flat tensor its parameters are views of:
        a gather resizes its storage and receives the broadcast straight into it, a release frees it."""
        self._flat_ids: set[int] = set()

    def flatten(self, units: list[Unit]) -> None:
        """Full only, before any pass: each group of CPU weights another rank owns becomes views into one flat
        tensor (one allocation per gather instead of one per parameter and a receive buffer, and no copy)."""
        if not self.full:
            return
        for unit in units:
            for group in unit.groups:
                owner, dtype, params = group
                if owner == self.rank or any(p.device.type != "cpu" for p in params):
                    continue
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype)
                offset = 0
                for p in params:
                    view = flat[offset : offset + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    offset += p.numel()
                self._flats[id(group)] = flat
                self._flat_ids.add(id(flat))

    def before_forward(self, unit: Unit) -> None:
        """`unit`'s forward starts: record the order (first forward), gather it, start gathering the next."""
        if not self.recorded and unit not in self.order:
            self.order.append(unit)
        self.gather(unit)
        self._prefetch_after(unit)

    def gather(self, unit: Unit) -> None:
        """Every owner's weights of `unit` to every rank (full only: otherwise every rank holds them); from its
        prefetch when one is in flight."""
        if unit.gathered:
            return
        unit.gathered = True
        with self.clock.timed():
            pieces = self._pending.pop(id(unit), None) or self._broadcasts(unit, async_op=False)
            for work, flat, owner, params in pieces:
                if work is not None:
                    work.wait()
                if owner == self.rank or id(flat) in self._flat_ids:
                    continue
                offset = 0
                for p in params:  # through .data: autograd's saved weights must not look modified
                    p.data.untyped_storage().resize_(storage_bytes(p))
                    p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _broadcasts(self, unit: Unit, async_op: bool) -> Pieces:
        """One broadcast per owner and dtype of `unit`'s weights into host buffers."""
        out = []
        for group in unit.groups:
            owner, dtype, params = group
            flat = self._flats.get(id(group))
            if flat is not None:
                _resize(flat, whole=True)
            elif owner == self.rank:
                flat = replicas.flat_on_host(params, dtype)
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype)
            work = dist.broadcast(flat, src=owner, async_op=async_op)
            out.append((work if async_op else None, flat, owner, params))
        return out

    def _prefetch_after(self, unit: Unit) -> None:
        """Start gathering the block that ran after `unit` in the first forward, so that its broadcasts overlap
        `unit`'s compute (every rank has recorded the same order and prefetches alike)."""
        order = self.order
        if not self.full or unit not in order or order.index(unit) + 1 >= len(order):
            return
        after = order[order.index(unit) + 1]
        if not after.gathered and id(after) not in self._pending:
            with self.clock.timed():
                self._pending[id(after)] = self._broadcasts(after, async_op=True)
                self.prefetched += 1

    def drop_prefetched(self) -> None:
        """Wait for prefetches nobody used (the weights they carry change at the step) and drop them."""
        for pieces in self._pending.values():
            for work, flat, *_ in pieces:
                work.wait()
                if id(flat) in self._flat_ids:
                    _resize(flat, whole=False)
        self._pending.clear()

    def release(self, unit: Unit) -> None:
        """Free the weights of `unit` this rank does not own (full only)."""
        if not self.full or not unit.gathered:
            return
        unit.gathered = False
        for group in unit.groups:
            owner, _, params = group
            flat = self._flats.get(id(group))
            if flat is not None:
                _resize(flat, whole=False)
            elif owner != self.rank:
                for p in params:
                    p.data.untyped_storage().resize_(0)

    def make_whole(self, units: list[Unit]) -> None:
        """Every weight whole again and in a storage of its own, as zeros where it was not gathered (its values
        come from the state loaded next)."""
        self.drop_prefetched()
        for unit in units:
            for group in unit.groups:
                owner, _, params = group
                if id(group) in self._flats:
                    for p in params:
                        p.data = p.data.clone() if unit.gathered else torch.zeros_like(p)
                elif owner != self.rank and not unit.gathered:
                    for p in params:
                        p.data.untyped_storage().resize_(storage_bytes(p))
                        p.data.zero_()
            unit.gathered = True
        self._flats.clear()
        self._flat_ids.clear()


def _resize(flat: torch.Tensor, whole: bool) -> None:
    """Allocate (`whole`) or free the storage of a group's flat tensor, which its parameters' views share."""
    flat.untyped_storage().resize_(flat.numel() * flat.element_size() if whole else 0)
