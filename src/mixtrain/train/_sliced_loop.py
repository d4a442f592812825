"""prepare_model(model, shard="gradients" | "full"): a loop's model with its state sliced by owner, through the Task
path's engine (shard/sliced.py: the same hooks, owners, reduces to the owners and gathers).

The loop builds its optimizer after prepare_model, on what it returns, and steps it itself. After each backward,
each owned parameter's `.grad` is the global gradient (the sum over the workers, each weighted by its batch's share
of the step) and every other `.grad` is None, so the loop's own `optimizer.step()` steps, and keeps state for, only
this worker's slice: torch's optimizers skip a parameter without a gradient. With "gradients" the owners then send
their updated weights to the others (a step post-hook); with "full" each keeps its own. The clipping norm is the
global one: `model.clip_grad_norm_(max_norm)` (torch's own would see only this worker's slice).

Every backward sends gradients to their owners, so every worker runs as many forward-and-backward passes as the
others: prepare_data_loader hands every worker the same number of batches (a batch of no samples where its share
of a step is 0), and `no_sync()` accumulates by summing on the owners, not by skipping the exchange.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from mixtrain.comm.loop_grads import _queue_callback
from mixtrain.comm.strategy import JoinContext
from mixtrain.config import StrategyConfig
from mixtrain.devices import host_allocator
from mixtrain.errors import InputValueError
from mixtrain.shard.sliced import Level, SlicedStrategy
from mixtrain.shard.state import clip_to, merge_weights
from mixtrain.shard.units import tensors
from mixtrain.train._session import LoopSession

LEVELS = ("none", "gradients", "full")


def check_shard(shard: Any, slices: Any, world_size: int, blocks: Any = ()) -> tuple[float, ...] | None:
    """prepare_model's shard=, slices= and blocks=, checked: the slices' relative sizes (None: equal)."""
    if shard not in LEVELS:
        why = {
            "optimizer": " ('optimizer' alone is not offered: 'gradients' moves the same bytes and holds less)",
            "auto": " ('auto' is the Task path's: it weighs the optimizer's state, which a loop builds after "
            "prepare_model; `mixtrain plan` says which level fits)",
        }
        also = why.get(shard, "") if isinstance(shard, str) else ""
        raise InputValueError(
            f"prepare_model(shard={shard!r}): give 'none', 'gradients' (each worker keeps the optimizer state and "
            f"gradients of its slice) or 'full' (its slice of the weights too){also}"
        )
    if blocks and shard != "full":
        raise InputValueError(
            f"prepare_model(blocks={blocks!r}, shard={shard!r}): blocks name what shard='full' gathers one at a "
            "time; give shard='full' or no blocks"
        )
    if slices is None:
        return None
    if (
        not isinstance(slices, (list, tuple))
        or len(slices) != world_size
        or any(isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in slices)
        or sum(slices) <= 0
    ):
        raise InputValueError(
            f"prepare_model(slices={slices!r}): give one relative size >= 0 per worker ({world_size}), e.g. "
            f"{[1] * world_size}, or None for equal slices"
        )
    return tuple(float(s) for s in slices)


class SlicedLoop:
    """The prepared model's sliced state on this worker: the engine, the loop's backward end, its optimizer's step."""

    def __init__(
        self,
        module: torch.nn.Module,
        session: LoopSession,
        level: Level,
        slices: tuple[float, ...] | None,
        blocks: tuple[str | type[torch.nn.Module], ...] = (),
    ):
        self.session = session
        self.strategy = SlicedStrategy(StrategyConfig(), level)
        ctx = JoinContext(
            bucket_bytes=session.bucket_bytes,
            loss_scaling=False,  # the loop keeps its own precision (and its own GradScaler, if any)
            rank=session.context.world_rank,
            world_size=session.context.world_size,
            timeout_s=0.0,  # (read by the parameter-server strategies only)
            shard_weights=slices,
        )
        host_allocator.sliced_state(True)  # as a Task's sliced worker (TrainWorker.join): freed blocks go back
        self.strategy.setup_loop(module, ctx, blocks)
        host_allocator.trim()  # the weights others own, built whole and freed by the setup
        if level == "full":  # torch would write into freed memory (a crash, not an error)
            module.register_load_state_dict_pre_hook(_refuse_load)
        self.params = {id(p) for unit in self.strategy.units for p in unit.params}
        self.owned: list[torch.nn.Parameter] = []
        self._queued = False
        self._t_forward: float | None = None
        me = weakref.ref(self)  # process-wide hooks: they must not keep a finished loop's model alive
        self._hooks = [
            register_optimizer_step_pre_hook(lambda opt, *_: _call(me, "_before_step", opt)),
            register_optimizer_step_post_hook(lambda opt, *_: _call(me, "_after_step", opt)),
        ]
        weakref.finalize(self, _remove, list(self._hooks))

    @property
    def comm_s(self) -> float:
        """Seconds in the collectives so far (the session's speed measurement leaves them out)."""
        return self.strategy.clock.seconds

    # ---- forward and backward -----------------------------------------------------------------------
    def before_forward(self) -> None:
        if self._t_forward is None:
            self._t_forward = time.perf_counter()

    def weigh(self, output: Any) -> Any:
        """The gradient into `output` times this batch's share of its step (0 for a batch of no samples): each
        worker's mean loss becomes its part of the global batch's mean, as LoopGrads weighs its buckets."""
        weight = self.session.weight
        for t in tensors(output):
            if t.requires_grad:
                t.register_hook(self._weighted(weight))
        return output

    def _weighted(self, weight: float) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._queued:
                self._queued = True
                _queue_callback(self._after_backward)
            if weight == 0.0:  # no samples: whatever the mean over none made (NaN) counts for nothing
                return torch.zeros_like(grad)
            return grad if weight == 1.0 else grad * weight

        return hook

    def _after_backward(self) -> None:
        self._queued = False
        if self._t_forward is not None:
            self.session.work_done(time.perf_counter() - self._t_forward)
        self._t_forward = None
        self.owned = self.strategy.finish_backward()

    # ---- the loop's optimizer -----------------------------------------------------------------------
    def _covers(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self.params for g in optimizer.param_groups for p in g["params"])

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the state of parameters another worker owns (a whole optimizer state just loaded): they never step
        here."""
        if not self._covers(optimizer):
            return
        owner, rank = self.strategy.owner, self.strategy.rank
        for p in [p for p in optimizer.state if owner.get(id(p), rank) != rank]:
            del optimizer.state[p]

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._covers(optimizer) and self.strategy.level == "gradients":
            self.strategy.broadcast_owned()

    # ---- clipping and whole state -------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        owned = [p for p in self.owned if p.grad is not None]
        norm = self.strategy.global_grad_norm(owned)
        clip_to([p.grad for p in owned if p.grad is not None], max_norm, norm)
        return torch.tensor(norm)

    def full_state_dict(self, module: torch.nn.Module, rank0_only: bool = False) -> dict[str, Any]:
        """The module's whole state_dict on every worker (with "full", each owner's weights gathered); with
        `rank0_only`, on worker 0 alone (every other worker gets {} and never holds the whole)."""
        rank = self.session.context.world_rank
        if self.strategy.level != "full":
            return {} if rank0_only and rank != 0 else module.state_dict()
        view = _ModelOnly(module)
        state = self.strategy.model_state(view)  # type: ignore[arg-type]
        mine = {k: v.detach().cpu() for k, v in self.strategy.model_part(view).items()}  # type: ignore[arg-type]
        parts = self._gather(mine, rank0_only)
        return {} if parts is None else merge_weights(state, [part or {} for part in parts])

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict[str, Any]:
        """The optimizer's whole state_dict on every worker (each worker's entries, its own slice, gathered); with
        `rank0_only`, on worker 0 alone (every other worker gets {})."""
        sd = optimizer.state_dict()
        mine = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in sd["state"].items()}
        parts = self._gather(mine, rank0_only)
        if parts is None:
            return {}
        merged: dict[int, Any] = {}
        for part in parts:
            merged.update(part or {})
        sd["state"] = dict(sorted(merged.items()))
        return sd

    def _gather(self, mine: dict[Any, Any], rank0_only: bool) -> list[Any] | None:
        """Every worker's `mine`, in rank order: on every worker, or (rank0_only) on worker 0 alone (None elsewhere)."""
        world, rank = self.session.context.world_size, self.session.context.world_rank
        parts: list[Any] = [None] * world
        if not rank0_only:
            dist.all_gather_object(parts, mine)
            return parts
        dist.gather_object(mine, parts if rank == 0 else None, dst=0)
        return parts if rank == 0 else None


class _ModelOnly:
    """What SlicedStrategy's state methods read of a Task: its model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def _call(ref: weakref.ref[SlicedLoop], name: str, optimizer: torch.optim.Optimizer) -> None:
    loop = ref()
    if loop is not None:
        getattr(loop, name)(optimizer)


def _refuse_load(*_: Any) -> None:
    raise InputValueError(
        "load_state_dict on a model prepared with shard='full': each worker holds only its slice of the weights; "
        "load the whole state into the model before prepare_model (model.load_state_dict(...); then "
        "prepare_model(model, shard='full'))"
    )


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
