"""What a model needs in memory, measured on the CPU: the numbers the memory plan (memory_plan.py) works from.

Every figure is measured, not looked up: the weights from the parameters, the optimizer state by stepping a copy of
the optimizer once, the activations from the tensors autograd saves in a real forward pass at two micro-batch sizes
(a straight line: bytes per sample and a fixed part), the training FLOPs of one sample with torch's FLOP counter.
The repeated layer class ("block") is found as FSDP's auto-wrap would take it: the module class with at least two
instances that holds the most parameters (GPT2Block, TransformerEncoderLayer, ...), or the one the caller names.
Blocks and the rest ("root": embeddings, final norm, head) are measured apart, so the same shape with more or fewer
blocks can be predicted (`ModelShape.scaled`) without building it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixtrain.errors import InputValueError
from mixtrain.shard.blocks import block_class as find_block


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A model's memory figures in bytes, measured on the CPU (fp32 unless the model is in another dtype)."""

    num_parameters: int
    """Parameter elements, tied ones once."""
    trainable_bytes: int
    """W: parameters with requires_grad (their gradients are as large)."""
    frozen_bytes: int
    """F: frozen parameters and buffers, held whole under every level."""
    optimizer_bytes: int
    """O: the optimizer's state after one step (AdamW: 2 x 4 bytes per trainable element; SGD momentum: 1x)."""
    block_name: str | None
    """The repeated layer class, or None when the model has none."""
    num_blocks: int
    """Instances of that class."""
    block_bytes: int
    """U: trainable bytes of the largest block."""
    block_frozen_bytes: float
    """Frozen parameter and buffer bytes of a block, on average."""
    root_bytes: int
    """R: trainable bytes outside every block (embeddings, final norm, head; tied ones once)."""
    activation_per_sample: tuple[float, float]
    """Saved-activation bytes per sample: (outside the blocks, in one block)."""
    activation_fixed: tuple[float, float]
    """Saved-activation bytes that do not grow with the micro-batch: (outside the blocks, in one block)."""
    flops_per_sample: tuple[float, float]
    """Forward and backward FLOPs of one sample (torch.utils.flop_counter: matrix products, convolutions,
    attention): (outside the blocks, in one block)."""

    @property
    def block_mean_bytes(self) -> float:
        """Trainable bytes of a block, on average (the blocks of a shape need not all be equal)."""
        return (self.trainable_bytes - self.root_bytes) / self.num_blocks if self.num_blocks else 0.0

    @property
    def flops(self) -> float:
        """Forward and backward FLOPs of one sample, the whole model."""
        return self.flops_per_sample[0] + self.num_blocks * self.flops_per_sample[1]

    def activation_bytes(self, micro_batch: int) -> float:
        """A(b): bytes the forward pass keeps for backward at micro-batch `micro_batch`."""
        root = self.activation_fixed[0] + self.activation_per_sample[0] * micro_batch
        block = self.activation_fixed[1] + self.activation_per_sample[1] * micro_batch
        return root + self.num_blocks * block

    def scaled(self, num_blocks: int) -> ModelShape:
        """The same shape with `num_blocks` blocks: the root, a block's bytes and activations stay; the optimizer
        state follows the trainable bytes."""
        if not self.num_blocks:
            raise InputValueError(f"{self.describe()}: no repeated block to add or remove; name it with block=")
        extra = num_blocks - self.num_blocks
        trainable = self.trainable_bytes + extra * self.block_mean_bytes
        per_byte = self.optimizer_bytes / self.trainable_bytes if self.trainable_bytes else 0.0
        bytes_per_element = self.trainable_bytes / self.num_parameters if self.num_parameters else 4.0
        return dataclasses.replace(
            self,
            num_parameters=round(self.num_parameters + extra * self.block_mean_bytes / bytes_per_element),
            trainable_bytes=round(trainable),
            frozen_bytes=round(self.frozen_bytes + extra * self.block_frozen_bytes),
            optimizer_bytes=round(trainable * per_byte),
            num_blocks=num_blocks,
        )

    def describe(self) -> str:
        blocks = f"{self.num_blocks} x {self.block_name}" if self.block_name else "no repeated block"
        return f"{self.num_parameters / 1e6:,.1f}M parameters, {blocks}"


def measure_shape(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss: Callable[[nn.Module, int], torch.Tensor],
    *,
    micro_batches: tuple[int, int] = (1, 2),
    block: str | None = None,
) -> ModelShape:
    """Measure `model` on the CPU. `loss(model, b)` runs one forward pass at micro-batch b and returns the loss
    (a Task's batch_loss on a batch of the data); it is called at both `micro_batches` under the saved-tensor
    hooks, and backward runs under the FLOP counter. The model and the optimizer are left as they were."""
    small, large = micro_batches
    if not 1 <= small < large:
        raise InputValueError(f"micro_batches={micro_batches!r}: give two sizes, 1 <= first < second, e.g. (1, 2)")
    blocks, base = _state(model, optimizer_state_bytes(model, optimizer), block)
    at_small, flops_small = _activations(model, loss, small, blocks)
    at_large, _ = _activations(model, loss, large, blocks)
    slope = tuple((hi - lo) / (large - small) for lo, hi in zip(at_small, at_large))
    fixed = tuple(max(0.0, lo - s * small) for lo, s in zip(at_small, slope))
    per_block = len(blocks) or 1
    return dataclasses.replace(
        base,
        activation_per_sample=(slope[0], slope[1] / per_block),
        activation_fixed=(fixed[0], fixed[1] / per_block),
        flops_per_sample=(flops_small[0] / small, flops_small[1] / small / per_block),
    )


def state_shape(model: nn.Module, optimizer: torch.optim.Optimizer, *, block: str | None = None) -> ModelShape:
    """The training state's figures without running or copying anything (activations and FLOPs 0): what the
    bring-up weighs for ScalingConfig(shard="auto") on each worker, where the model is built. The optimizer's
    state is `expected_optimizer_bytes`."""
    return _state(model, expected_optimizer_bytes(optimizer), block)[1]


def _state(model: nn.Module, optimizer_bytes: int, block: str | None) -> tuple[list[nn.Module], ModelShape]:
    """The blocks, and the shape's state figures (weights, frozen, blocks, root; activations and FLOPs 0)."""
    cls = find_block(model, block)
    blocks = [m for m in model.modules() if cls is not None and type(m) is cls]
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    in_blocks = {id(p): p for b in blocks for p in b.parameters() if p.requires_grad}
    frozen = _bytes(p for p in params if not p.requires_grad) + _bytes(model.buffers())
    block_frozen = _bytes(p for b in blocks for p in b.parameters() if not p.requires_grad) + _bytes(
        buf for b in blocks for buf in b.buffers()
    )
    shape = ModelShape(
        num_parameters=sum(p.numel() for p in params),
        trainable_bytes=_bytes(trainable),
        frozen_bytes=frozen,
        optimizer_bytes=optimizer_bytes,
        block_name=cls.__name__ if cls else None,
        num_blocks=len(blocks),
        block_bytes=max((_bytes(p for p in b.parameters() if p.requires_grad) for b in blocks), default=0),
        block_frozen_bytes=block_frozen / (len(blocks) or 1),
        root_bytes=_bytes(trainable) - _bytes(in_blocks.values()),
        activation_per_sample=(0.0, 0.0),
        activation_fixed=(0.0, 0.0),
        flops_per_sample=(0.0, 0.0),
    )
    return blocks, shape


def optimizer_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state after one step, measured by stepping a deep copy (model and optimizer
    together, so the copy's parameters are the copy's model's) with zero gradients."""
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    for p in model_copy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer_copy.step()
    return _held(optimizer_copy)


def expected_optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state once it has stepped, without stepping: what it holds where it has state
    already, else per trainable parameter from its class and settings (SGD: 1x with momentum, 0 without; Adam and
    AdamW: 2x, 3x with amsgrad; Adagrad 1x; RMSprop 1x, +1 with momentum, +1 centered); any other class AdamW's
    2x, assumed."""
    if optimizer.state:
        return _held(optimizer)
    total = 0.0
    for group in optimizer.param_groups:
        trainable = _bytes(p for p in group["params"] if p.requires_grad)
        total += trainable * _state_per_weight(optimizer, group)
    return round(total)


def _state_per_weight(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return 2


def _held(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state, each storage once."""
    seen: dict[int, torch.Tensor] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                seen[value.untyped_storage().data_ptr() or id(value)] = value
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _activations(
    model: nn.Module, loss: Callable[[nn.Module, int], torch.Tensor], micro_batch: int, blocks: list[nn.Module]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(saved bytes, forward+backward FLOPs) of one micro-batch, each as (outside the blocks, in all blocks). A
    storage autograd saves is counted once, where it is first saved; parameters' own storages are left out (they are
    the weights). A storage made outside a block and saved first inside one counts as the block's."""
    from torch.utils.flop_counter import FlopCounterMode

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, bool]] = {}
    inside = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in saved and t.device.type != "meta":
            saved[key] = (storage.nbytes(), inside[0] > 0)
        return t

    was_training = model.training
    model.train()
    counter = FlopCounterMode(display=False)
    try:
        with _inside_blocks(blocks, inside), counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss(model, micro_batch)
            out.backward()
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    in_blocks = sum(n for n, b in saved.values() if b)
    names = {f"{type(model).__name__}.{n}" for n, m in model.named_modules() if any(m is b for b in blocks)}
    counts = counter.get_flop_counts()
    block_flops = float(sum(sum(counts.get(n, {}).values()) for n in names))
    total = float(counter.get_total_flops())
    return (sum(n for n, b in saved.values() if not b), in_blocks), (total - block_flops, block_flops)


@contextmanager
def _inside_blocks(blocks: list[nn.Module], depth: list[int]) -> Iterator[None]:
    """depth[0] > 0 while a block's forward runs."""

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure_task(
    task: Any, batch: Callable[[int], Any], *, block: str | None = None, micro_batches: tuple[int, int] = (1, 2)
) -> ModelShape:
    """`measure_shape` for a mixtrain Task: `batch(b)` makes a CPU batch of b samples (of the job's data)."""
    return measure_shape(
        task.model,
        task.optimizer,
        lambda model, b: task.batch_loss(model, batch(b)),
        micro_batches=micro_batches,
        block=block,
    )
