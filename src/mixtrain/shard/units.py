"""What the sliced strategy's collectives work on: a block (or the root) with its trainable parameters grouped by
owner, and the clock their seconds and bytes are counted on."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from mixtrain.errors import InputValueError
from mixtrain.shard.blocks import block_of_each_parameter, find_blocks


@dataclass(eq=False)
class Unit:
    """A block (or the root) and its trainable parameters, grouped by owner for the collectives."""

    module: torch.nn.Module | None
    """None: the root (every parameter in no block)."""
    params: list[torch.nn.Parameter]
    groups: list[tuple[int, torch.dtype, list[torch.nn.Parameter]]] = field(default_factory=list)
    """(owner, dtype, parameters): one broadcast and one reduce each."""
    gathered: bool = True
    backward: bool = False
    """Its backward has started and its gradients have not gone to their owners yet."""
    waiting: set[int] = field(default_factory=set)
    """ids of the parameters whose gradient this backward has not produced yet."""


class CommClock:
    """Seconds spent in the collectives and bytes sent, since they were last taken."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.sent = 0

    @contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def take(self) -> tuple[float, int]:
        """(seconds, bytes) so far, and both back to zero."""
        out = (self.seconds, self.sent)
        self.seconds, self.sent = 0.0, 0
        return out


def make_units(
    model: torch.nn.Module,
    ordered: list[torch.nn.Parameter],
    owner: dict[int, int],
    names: Sequence[str | type[torch.nn.Module]] = (),
) -> list[Unit]:
    """The root first, then each block (the classes `names`, else the one found), with the trainable parameters
    each holds (a parameter shared by two blocks, or by a block and the root, belongs to the root), grouped by
    `owner` (id(parameter) -> rank)."""
    blocks = find_blocks(model, names)
    block_of = block_of_each_parameter(model, blocks)
    units = [Unit(None, [p for p in ordered if id(p) not in block_of])]
    for i, block in enumerate(blocks):
        params = [p for p in ordered if block_of.get(id(p)) == i]
        if params:
            units.append(Unit(block, params))
    for unit in units:
        by_key: dict[tuple[int, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in unit.params:
            by_key.setdefault((owner[id(p)], p.dtype), []).append(p)
        unit.groups = [(rank, dtype, ps) for (rank, dtype), ps in sorted(by_key.items(), key=lambda kv: kv[0][0])]
    return units


def storage_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the storages of `tensors` hold now, each storage once (a gathered group's weights are views of one;
    another owner's weights hold 0)."""
    storages = {t.untyped_storage().data_ptr() or id(t): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values())


def check_sliceable(name: str, p: torch.nn.Parameter) -> None:
    """A parameter's storage is freed and re-allocated whole: it must be the parameter's alone."""
    if p.storage_offset() != 0 or p.untyped_storage().nbytes() != storage_bytes(p) or not p.is_contiguous():
        raise InputValueError(
            f"shard='full': parameter {name!r} is a view into a larger tensor, whose memory cannot be freed "
            "alone; make it its own nn.Parameter, or use shard='gradients'"
        )


def tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from tensors(item)
