"""Gradients, and with shard="full" the weights too, sliced by memory across unlike devices (ZeRO-2 and -3).

Each trainable parameter has one owner (whole parameters, contiguous runs of the optimizer's parameters sized
by each worker's memory: comm/zero.py's split), which alone keeps its optimizer state and steps it. The compute
shares are decided apart, by speed, as for every strategy.

- "gradients": every worker holds the whole weights. As each block's backward ends, its gradients are summed
  onto their owners (a reduce per owner) and dropped everywhere else, so no worker holds the whole gradient;
  after the owners step, each broadcasts its updated run (as the sliced optimizer does).
- "full": a worker keeps only the weights it owns. A block's weights are gathered (a broadcast from each
  owner) just before its forward and freed after it, gathered again when its backward starts and freed when
  its gradients have gone to their owners; the parameters in no block (the root: embeddings, a tied head,
  the final norm) are gathered for the whole step. An owner steps only what it owns: nothing is broadcast.

Every collective is matched on every rank, so every rank runs as many forward and backward passes per step
(the worker cuts its share into as many micro-batches as the busiest rank needs; a rank with fewer samples
runs zero-weighted passes, in eval mode so no statistics or random streams move), and held-out batches are
evened out the same way. Frozen parameters (not in the optimizer) stay whole on every worker.

The math is one process's: each owner receives the sum of every rank's sample-weighted gradient, steps its
parameters with the user's optimizer class (each parameter's update depends on its own gradient and state
only), and the clipping norm is the global one (the owners' squared sums, summed).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from mixtrain.comm import replicas
from mixtrain.comm.link_measure import all_reduce_probe, exchange_seconds
from mixtrain.comm.strategy import JoinContext, RoundSync, StepOutcome, StepResult, SyncStrategy
from mixtrain.comm.zero import ShardedOptimizer, split_runs
from mixtrain.config import StrategyConfig
from mixtrain.devices.precision import LossScale
from mixtrain.errors import InputValueError
from mixtrain.shard.blocks import block_of_each_parameter, find_blocks
from mixtrain.task import Task

Level = Literal["gradients", "full"]


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


def _storage_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _check_sliceable(name: str, p: torch.nn.Parameter) -> None:
    """A parameter's storage is freed and re-allocated whole: it must be the parameter's alone."""
    if p.storage_offset() != 0 or p.untyped_storage().nbytes() != _storage_bytes(p) or not p.is_contiguous():
        raise InputValueError(
            f"shard='full': parameter {name!r} is a view into a larger tensor, whose memory cannot be freed "
            "alone; make it its own nn.Parameter, or use shard='gradients'"
        )


class SlicedStrategy(SyncStrategy):
    """All-reduce's math with gradients (and weights, at "full") kept by their owners only."""

    name = "allreduce"
    stats_on_device = False
    lockstep = True

    def __init__(self, config: StrategyConfig, level: Level) -> None:
        super().__init__(config)
        self.level: Level = level
        self.slices_weights = level == "full"
        self._pending_optimizer: dict[str, Any] | None = None
        self._hooks: list[Any] = []
        self.units: list[Unit] = []
        self.shard: ShardedOptimizer | None = None
        self._acc: dict[int, torch.Tensor] = {}
        self._comm_s = 0.0
        self._sent = 0
        self.owned: list[torch.nn.Parameter] = []
        """This rank's trainable parameters (it alone steps them, and at "full" alone keeps them)."""
        self._order: list[Unit] = []
        """The blocks in the order the first forward ran them (then: which block to prefetch next)."""
        self._recorded = False
        self.prefetched = 0
        """Blocks whose gather was started ahead of their forward (for tests and profiles)."""
        self._pending: dict[int, list[tuple[Any, torch.Tensor, int, list[torch.nn.Parameter]]]] = {}

    # ---- forming -------------------------------------------------------------------------------
    def setup(self, task: Task, ctx: JoinContext) -> None:
        model = task.model
        self.rank = ctx.rank
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)
        replicas.broadcast_state(model)  # every replica whole and equal before it is sliced
        ordered = [p for g in task.optimizer.param_groups for p in g["params"]]
        weights = ctx.shard_weights or (1.0,) * ctx.world_size
        runs = split_runs([p.numel() for p in ordered], weights)
        self.owner = {id(p): r for r, (lo, hi) in enumerate(runs) for p in ordered[lo:hi]}
        self.shard = ShardedOptimizer(task.optimizer, runs, ctx.rank, offload=ctx.offload)
        task.optimizer.state.clear()  # the user's optimizer only carries hyperparameters from now on
        if self._pending_optimizer is not None:
            self.shard.load_full(self._pending_optimizer)
        self._pending_optimizer = None
        if self.level == "full":
            names = {id(p): n for n, p in model.named_parameters()}
            for p in ordered:
                _check_sliceable(names.get(id(p), "?"), p)
        self.owned = [p for p in ordered if self.owner[id(p)] == ctx.rank]
        self.units = self._units(model, ordered)
        self._register(model)
        for unit in self.units:
            self._release(unit)

    def _units(self, model: torch.nn.Module, ordered: list[torch.nn.Parameter]) -> list[Unit]:
        """The root first, then each block, with the trainable parameters each holds (a parameter shared by
        two blocks, or by a block and the root, belongs to the root)."""
        blocks = find_blocks(model)
        block_of = block_of_each_parameter(model, blocks)
        units = [Unit(None, [p for p in ordered if id(p) not in block_of])]
        for i, block in enumerate(blocks):
            params = [p for p in ordered if block_of.get(id(p)) == i]
            if params:
                units.append(Unit(block, params))
        for unit in units:
            by_key: dict[tuple[int, torch.dtype], list[torch.nn.Parameter]] = {}
            for p in unit.params:
                by_key.setdefault((self.owner[id(p)], p.dtype), []).append(p)
            unit.groups = [(owner, dtype, ps) for (owner, dtype), ps in sorted(by_key.items(), key=lambda kv: kv[0][0])]
        return units

    def _register(self, model: torch.nn.Module) -> None:
        root = self.units[0]
        self._hooks.append(model.register_forward_pre_hook(lambda *_: self._gather(root)))
        self._hooks.append(model.register_forward_hook(lambda *_: self._after_model_forward(root)))
        for unit in self.units[1:]:
            assert unit.module is not None
            self._hooks.append(unit.module.register_forward_pre_hook(self._before_forward(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._after_forward(unit)))
            for p in unit.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready(unit)))

    def _after_model_forward(self, root: Unit) -> None:
        self._recorded = True
        if not torch.is_grad_enabled():  # no backward follows (evaluation): the root's weights go now
            self._release(root)

    def _before_forward(self, unit: Unit) -> Any:
        def hook(*_: Any) -> None:
            if not self._recorded and unit not in self._order:
                self._order.append(unit)
            self._gather(unit)
            self._prefetch_after(unit)

        return hook

    def _after_forward(self, unit: Unit) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if unit.backward:  # a recomputation inside backward (activation checkpointing): keep the weights
                return
            self._release(unit)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(self._backward_starts(unit))

        return hook

    def _backward_starts(self, unit: Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not unit.backward:
                unit.backward = True
                unit.waiting = {id(p) for p in unit.params}
                self._gather(unit)

        return hook

    def _grad_ready(self, unit: Unit) -> Any:
        def hook(p: torch.Tensor) -> None:
            unit.waiting.discard(id(p))
            if unit.backward and not unit.waiting:
                self._reduce(unit)

        return hook

    # ---- the collectives ---------------------------------------------------------------------
    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._comm_s += time.perf_counter() - t0

    def _gather(self, unit: Unit) -> None:
        """Every owner's weights of `unit` to every rank (full only: otherwise every rank holds them); from its
        prefetch when one is in flight."""
        if unit.gathered:
            return
        unit.gathered = True
        with self._timed():
            pieces = self._pending.pop(id(unit), None) or self._broadcasts(unit, async_op=False)
            for work, flat, owner, params in pieces:
                if work is not None:
                    work.wait()
                if owner == self.rank:
                    continue
                offset = 0
                for p in params:  # through .data: autograd's saved weights must not look modified
                    p.data.untyped_storage().resize_(_storage_bytes(p))
                    p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def _broadcasts(self, unit: Unit, async_op: bool) -> list[tuple[Any, torch.Tensor, int, list[torch.nn.Parameter]]]:
        """One broadcast per owner and dtype of `unit`'s weights into host buffers: (work or None, buffer, owner,
        parameters)."""
        out = []
        for owner, dtype, params in unit.groups:
            flat = (
                replicas.flat_on_host(params, dtype)
                if owner == self.rank
                else torch.empty(sum(p.numel() for p in params), dtype=dtype)
            )
            work = dist.broadcast(flat, src=owner, async_op=async_op)
            out.append((work if async_op else None, flat, owner, params))
        return out

    def _prefetch_after(self, unit: Unit) -> None:
        """Start gathering the block that ran after `unit` in the first forward, so that its broadcasts overlap
        `unit`'s compute (every rank has recorded the same order and prefetches alike)."""
        order = self._order
        if self.level != "full" or unit not in order or order.index(unit) + 1 >= len(order):
            return
        after = order[order.index(unit) + 1]
        if not after.gathered and id(after) not in self._pending:
            with self._timed():
                self._pending[id(after)] = self._broadcasts(after, async_op=True)
                self.prefetched += 1

    def _drop_prefetched(self) -> None:
        """Wait for prefetches nobody used (the weights they carry change at the step) and drop them."""
        for pieces in self._pending.values():
            for work, *_ in pieces:
                work.wait()
        self._pending.clear()

    def _release(self, unit: Unit) -> None:
        """Free the weights of `unit` this rank does not own (full only)."""
        if self.level != "full" or not unit.gathered:
            return
        unit.gathered = False
        for owner, _, params in unit.groups:
            if owner != self.rank:
                for p in params:
                    p.data.untyped_storage().resize_(0)

    def _reduce(self, unit: Unit) -> None:
        """Each owner receives the sum over ranks of its parameters' gradients in `unit` (zeros for a parameter
        this rank's pass did not reach); every other rank drops them. Then the unit's weights are freed."""
        unit.backward = False
        unit.waiting = set()
        with self._timed():
            for owner, _, params in unit.groups:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                flat = replicas.flat_on_host(grads, torch.float32)
                dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM)
                self._sent += flat.numel() * flat.element_size()
                if owner == self.rank:
                    offset = 0
                    for p in params:
                        n = p.numel()
                        part = flat[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype)
                        offset += n
                        if id(p) in self._acc:
                            self._acc[id(p)].add_(part)
                        else:  # (a view into `flat`, which holds only this owner's gradients)
                            self._acc[id(p)] = part
                for p in params:
                    p.grad = None
        self._release(unit)

    # ---- the step ------------------------------------------------------------------------------
    def zero_grad(self, task: Task) -> None:
        self._acc.clear()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        assert self.shard is not None
        self._drop_prefetched()
        owned = self._gradients_to_owners()
        summed = self._sum_stats_and_squares(local_stats, owned)
        total_stats = summed[:-1].to(torch.float32)
        used = self.loss_scale.scale
        applied = bool(torch.isfinite(summed).all())
        self.loss_scale.update(applied)
        norm = self._apply(task, owned, float(summed[-1]) ** 0.5 / used, used) if applied else None
        for p in owned:
            p.grad = None
        comm_s, self._comm_s = self._comm_s, 0.0
        sent, self._sent = self._sent, 0
        return StepOutcome(done=[StepResult(applied, total_stats)], comm_s=comm_s, sent_bytes=sent, grad_norm=norm)

    def _gradients_to_owners(self) -> list[torch.nn.Parameter]:
        """The passes are over: what has not gone to its owner yet (the root's gradients, summed over the passes;
        a block some parameter of which no pass reached) goes now, and (the root's weights freed) each owned
        parameter's .grad becomes the sum over ranks; every other .grad is None. Returns the owned parameters."""
        for unit in self.units[1:]:
            if unit.backward:
                self._reduce(unit)
        self._reduce(self.units[0])
        for p in self.owned:
            p.grad = self._acc.pop(id(p), None)
        return self.owned

    def _apply(self, task: Task, owned: list[torch.nn.Parameter], norm: float, used: float) -> torch.Tensor | None:
        """Unscale and clip the owned gradients (by the global `norm`), step them; the norm when the task clips."""
        assert self.shard is not None
        grads = [p.grad for p in owned if p.grad is not None]
        if used != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / used)
        if task.max_grad_norm is not None:
            clip_to(grads, task.max_grad_norm, norm)
        t0 = time.perf_counter()
        self.shard.step(broadcast=self.level == "gradients")
        if self.level == "gradients":  # the owners' broadcast of their updated weights
            self._comm_s += time.perf_counter() - t0
        if task.scheduler is not None:
            task.scheduler.step()
        return torch.tensor(norm) if task.max_grad_norm is not None else None

    def _sum_stats_and_squares(self, local_stats: torch.Tensor, owned: list[torch.nn.Parameter]) -> torch.Tensor:
        """One all-reduce: the step's statistics summed over ranks, then the sum of the squared gradient (each
        owner's part of the global norm), in float64 (a NaN or Inf anywhere makes it non-finite)."""
        with self._timed():
            squares = [torch.sum(p.grad.detach().double() ** 2) for p in owned if p.grad is not None]
            sumsq = float(torch.stack(squares).sum()) if squares else 0.0
            stats = local_stats.detach().to("cpu", torch.float64).reshape(-1)
            summed = torch.cat([stats, torch.tensor([sumsq], dtype=torch.float64)])
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        replicas.average_buffers(task.model, weight)
        drift, rebroadcast = 0.0, False
        if self.level == "gradients":  # every replica holds the whole weights: they must agree
            drift, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        return RoundSync(drift, rebroadcast, time.perf_counter() - t0)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def shards_optimizer(self) -> bool:
        return True

    def load_optimizer_state(self, task: Task, state: dict[str, Any]) -> None:
        self._pending_optimizer = state

    def optimizer_state(self, task: Task) -> dict[str, Any]:
        assert self.shard is not None
        sd = task.optimizer.state_dict()
        sd["state"] = self.shard.state_part()
        return sd

    def model_state(self, task: Task) -> dict[str, Any]:
        """The model's state_dict with the weights other ranks own as None (the driver fills them in)."""
        return {k: (None if self._foreign(t) else v) for k, (t, v) in _entries(task.model).items()}

    def model_part(self, task: Task) -> dict[str, torch.Tensor]:
        """The weights this rank owns, by state_dict key."""
        return {k: v for k, (t, v) in _entries(task.model).items() if self._owns(t)}

    def _owns(self, t: torch.Tensor) -> bool:
        return self.level == "full" and self.owner.get(id(t)) == self.rank

    def _foreign(self, t: torch.Tensor) -> bool:
        return self.level == "full" and self.owner.get(id(t), self.rank) != self.rank

    def state_bytes(self, task: Task) -> dict[str, int]:
        assert self.shard is not None
        return {"optimizer": self.shard.state_bytes(), "strategy": 0}

    def held_bytes(self, task: Task) -> int:
        """Bytes of weights this rank holds right now (between steps: what it owns, and what is not sliced)."""
        return sum(p.untyped_storage().nbytes() for p in task.model.parameters())

    # ---- measuring -----------------------------------------------------------------------------
    def measure_comm(self, task: Task, repeats: int) -> float:
        nbytes = self.exchange_bytes(task)

        def exchange() -> None:
            for unit in self.units:
                if self.level == "full":
                    self._gather(unit)
                    self._release(unit)
                    self._gather(unit)
                for _, _, params in unit.groups:
                    for p in params:
                        p.grad = None
                self._reduce(unit)
            self._acc.clear()

        seconds = exchange_seconds(exchange, all_reduce_probe, nbytes, repeats)
        self._comm_s, self._sent = 0.0, 0
        return seconds

    def exchange_bytes(self, task: Task) -> int:
        """Bytes a rank moves per step: gradients to their owners, and the weights twice (full: a gather for
        forward, one for backward) or once (gradients: the owners' broadcast after the step)."""
        weights = sum(_storage_bytes(p) for unit in self.units for p in unit.params)
        return weights * (3 if self.level == "full" else 2)

    def close(self) -> None:
        """Hooks off, and every weight whole again (its values come from the state loaded next)."""
        self._drop_prefetched()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for unit in self.units:
            if not unit.gathered:
                for owner, _, params in unit.groups:
                    if owner != self.rank:
                        for p in params:
                            p.data.untyped_storage().resize_(_storage_bytes(p))
                            p.data.zero_()
                unit.gathered = True
        self._acc.clear()

    # ---- a user's own loop (train/_sliced_loop.py): it builds and steps its optimizer itself, after this -------
    def setup_loop(self, model: torch.nn.Module, ctx: JoinContext) -> None:
        """setup() before the loop's optimizer exists: owners by the model's trainable parameters in order, through
        a stand-in optimizer over them that never steps (the loop's own steps only what has a gradient: what this
        rank owns, see finish_backward)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        stand_in = torch.optim.SGD(trainable, lr=0.0)
        self.setup(Task(model=model, optimizer=stand_in, loss_fn=torch.nn.functional.mse_loss), ctx)

    def finish_backward(self) -> list[torch.nn.Parameter]:
        """A loop's backward has ended: the step's _gradients_to_owners (an owned .grad held before this backward
        rode along in the reduce: torch's accumulation). Returns the owned parameters."""
        return self._gradients_to_owners()

    def global_grad_norm(self, owned: list[torch.nn.Parameter]) -> float:
        """The 2-norm of the whole gradient: the owners' squared sums, summed (one all-reduce)."""
        return float(self._sum_stats_and_squares(torch.zeros(0), owned)[-1]) ** 0.5

    def broadcast_owned(self) -> None:
        """gradients: every owner sends its updated weights to the others (the sliced optimizer's broadcast)."""
        assert self.shard is not None
        with self._timed():
            self.shard.broadcast()


def clip_to(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale `grads` (this rank's part of a gradient whose global norm is `norm`) as torch's clip_grad_norm_ would."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)


def merge_weights(state: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A model_state() with every rank's model_part() filled in; every weight must have come from some owner."""
    for part in parts:
        state.update(part)
    missing = [k for k, v in state.items() if v is None]
    if missing:
        raise RuntimeError(f"the gathered weights lack {missing[:5]}: no worker owns them")
    return state


def _entries(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """state_dict key -> (the parameter or buffer itself, its state_dict value), without reading any weight."""
    objects: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        objects[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        objects[name] = b
    return {k: (objects.get(k, v), v) for k, v in model.state_dict().items()}


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
