"""A model's blocks: the repeated layer class whose parameters are gathered one block at a time (shard="full").

FSDP's auto-wrap by module class wraps each instance of a named class (GPT-2's `GPT2Block`); when none is
named, the class that repeats most heavily is taken (block_class: one rule for the engine and the what-if plan).
Parameters in no block (embeddings, the final norm, a head tied to the embedding) form the root, gathered for
the whole step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from mixtrain.errors import InputTypeError, InputValueError

CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Never a block: they only hold other modules."""


def find_blocks(model: torch.nn.Module, names: Sequence[str | type[nn.Module]] = ()) -> list[torch.nn.Module]:
    """The model's blocks, outermost instances only, in module order: the instances of the classes `names`
    (classes, or class names: e.g. (GPT2Block,) or ("GPT2Block",)), or of `block_class(model)`; none where nothing
    repeats. A named class the model does not hold is refused, naming the classes it does."""
    classes = [_named_class(model, n) for n in names] if names else [block_class(model)]
    chosen = tuple(c for c in classes if c is not None)
    if not chosen:
        return []
    found = [m for m in model.modules() if m is not model and isinstance(m, chosen)]
    inner = {id(sub) for m in found for sub in m.modules() if sub is not m}
    return [m for m in found if id(m) not in inner]  # a block inside another block belongs to the outer one


def check_named(model: nn.Module, names: object, where: str) -> tuple[str | type[nn.Module], ...]:
    """Named blocks as a Task (`where`="Task.shard_blocks") or prepare_model(blocks=) takes them: a tuple or list of
    module classes or class names, each held by the model; returned as a tuple, else refused in one line."""
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) or _is_module_class(n) for n in names):
        raise InputTypeError(f"{where}={names!r}: a tuple of module classes or class names, e.g. (GPT2Block,)")
    if names:
        try:
            find_blocks(model, names)
        except InputValueError as exc:
            raise InputValueError(f"{where}: {exc}") from None
    return tuple(names)


def _is_module_class(value: object) -> bool:
    return isinstance(value, type) and issubclass(value, nn.Module)


def _named_class(model: nn.Module, name: str | type[nn.Module]) -> type[nn.Module] | None:
    if isinstance(name, str):
        return block_class(model, name)
    if not any(isinstance(m, name) for m in model.modules() if m is not model):
        kinds = ", ".join(sorted({type(m).__name__ for m in model.modules() if m is not model}))
        raise InputValueError(f"block={name.__name__}: the model holds no module of that class; its classes: {kinds}")
    return name


def block_name(names: Sequence[str | type[nn.Module]]) -> str | None:
    """The first named block class's name (what the memory figures take), None when none is named."""
    return next((n if isinstance(n, str) else n.__name__ for n in names), None)


def block_class(model: nn.Module, name: str | None = None) -> type[nn.Module] | None:
    """The repeated layer class: `name` when given (a class name in the model), else the class with at least two
    instances whose instances hold the most parameters together (FSDP's ModuleWrapPolicy, found by itself),
    classes whose instances are all the same size first (a repeated layer: not GPT-2's two unlike Embeddings, which
    outweigh two blocks of a 2-layer model); on a tie the class with fewer instances (the outer one). None when
    nothing repeats."""
    classes: dict[type[nn.Module], list[nn.Module]] = {}
    for module in model.modules():
        if module is not model and not isinstance(module, CONTAINERS):
            classes.setdefault(type(module), []).append(module)
    if name is not None:
        # a class of that name, or made from one (activation checkpointing's Recomputed subclass of a block)
        found = [c for c in classes if name in {k.__name__ for k in c.__mro__}]
        if not found:
            kinds = ", ".join(sorted({c.__name__ for c in classes}))
            raise InputValueError(f"block={name!r}: the model has no module class of that name; its classes: {kinds}")
        return found[0]
    best: tuple[bool, int, int, type[nn.Module]] | None = None
    for cls, instances in classes.items():
        size = sum(p.numel() * p.element_size() for p in {id(p): p for m in instances for p in m.parameters()}.values())
        alike = len({sum(p.numel() for p in m.parameters()) for m in instances}) == 1
        key = (alike, size, -len(instances), cls)
        if len(instances) >= 2 and size > 0 and (best is None or key[:3] > best[:3]):
            best = key
    return best[3] if best else None


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
