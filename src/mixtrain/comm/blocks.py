"""A model's blocks: the repeated layer class whose parameters are gathered one block at a time (shard="full").

FSDP's auto-wrap by module class wraps each instance of a named class (GPT-2's `GPT2Block`); when none is
named, the class that repeats most heavily is taken: the class with at least two instances whose instances hold
the most parameters between them, a module of modules before a leaf (a transformer's layer before its Linear).
Parameters in no block (embeddings, the final norm, a head tied to the embedding) form the root, gathered for
the whole step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from mixtrain.errors import InputValueError


def _own_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: torch.nn.Module, names: Sequence[str] = ()) -> list[torch.nn.Module]:
    """The model's blocks, outermost instances only, in module order. `names`: class names to use (e.g.
    ("GPT2Block",)); none: the repeated class holding the most parameters, or no blocks at all."""
    by_class: dict[str, list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        if module is not model:
            by_class[type(module).__name__].append(module)
    if names:
        missing = [n for n in names if n not in by_class]
        if missing:
            raise InputValueError(
                f"shard blocks {list(names)}: the model has no module of class {', '.join(missing)}; its classes "
                f"are {', '.join(sorted(by_class))}"
            )
        chosen = [m for n in names for m in by_class[n]]
    else:
        repeated = {n: ms for n, ms in by_class.items() if len(ms) >= 2 and any(_own_params(m) for m in ms)}
        layers = {n: ms for n, ms in repeated.items() if any(True for _ in ms[0].children())}
        repeated = layers or repeated  # a layer (a module of modules) before a bare Linear that repeats more
        if not repeated:
            return []
        best = max(repeated, key=lambda n: sum(_own_params(m) for m in repeated[n]))
        chosen = repeated[best]
    inner = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
    ordered = [m for m in model.modules() if any(m is c for c in chosen)]
    return [m for m in ordered if id(m) not in inner]  # a block inside another block belongs to the outer one


def block_of_each_parameter(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> dict[int, int]:
    """id(parameter) -> the index of the block that alone uses it. A parameter also held by a module outside
    that block (a head tied to the embedding, a weight shared by two blocks) is in no block: the root's."""
    where: dict[int, set[int]] = defaultdict(set)
    inside = {id(sub): i for i, block in enumerate(blocks) for sub in block.modules()}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                where[id(p)].add(inside.get(id(module), -1))
    return {pid: next(iter(places)) for pid, places in where.items() if len(places) == 1 and -1 not in places}
