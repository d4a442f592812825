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
from collections.abc import Sequence
from typing import Any, Literal

import torch

from mixtrain.comm import replicas
from mixtrain.comm.link_measure import all_reduce_probe, exchange_seconds
from mixtrain.comm.strategy import JoinContext, RoundSync, StepOutcome, StepResult, SyncStrategy
from mixtrain.comm.zero import ShardedOptimizer, split_runs
from mixtrain.config import StrategyConfig
from mixtrain.devices.precision import LossScale
from mixtrain.shard import state, units
from mixtrain.shard.gather import WeightGather
from mixtrain.shard.hooks import register_hooks
from mixtrain.shard.reduce import GradReduce
from mixtrain.shard.state import clip_to
from mixtrain.shard.units import CommClock, Unit, check_sliceable, make_units, storage_bytes
from mixtrain.task import Task

Level = Literal["gradients", "full"]


class SlicedStrategy(SyncStrategy):
    """All-reduce's math with gradients (and weights, at "full") kept by their owners only: the owners and the
    optimizer's slices here; the gathers (shard/gather.py), the reduces (shard/reduce.py) and the hooks that run
    them (shard/hooks.py) apart."""

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
        self.clock = CommClock()
        """Seconds in the collectives and bytes sent, since the last step took them."""
        self.owned: list[torch.nn.Parameter] = []
        """This rank's trainable parameters (it alone steps them, and at "full" alone keeps them)."""
        self.gathers = WeightGather(0, self.slices_weights, self.clock)
        self.reduces = GradReduce(0, self.clock, self.gathers.release)

    @property
    def prefetched(self) -> int:
        """Blocks whose gather was started ahead of their forward (for tests and profiles)."""
        return self.gathers.prefetched

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
                check_sliceable(names.get(id(p), "?"), p)
        self.owned = [p for p in ordered if self.owner[id(p)] == ctx.rank]
        self.units = make_units(model, ordered, self.owner, task.shard_blocks)
        self.gathers = WeightGather(ctx.rank, self.slices_weights, self.clock)
        self.reduces = GradReduce(ctx.rank, self.clock, self.gathers.release)
        self.gathers.flatten(self.units)
        self._hooks = register_hooks(model, self.units, self.gathers, self.reduces)
        for unit in self.units:
            self.gathers.release(unit)

    # ---- the step ------------------------------------------------------------------------------
    def zero_grad(self, task: Task) -> None:
        self.reduces.acc.clear()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        assert self.shard is not None
        self.gathers.drop_prefetched()
        owned = self.reduces.to_owners(self.units, self.owned)
        summed = self.reduces.sum_stats_and_squares(local_stats, owned)
        total_stats = summed[:-1].to(torch.float32)
        used = self.loss_scale.scale
        applied = bool(torch.isfinite(summed).all())
        self.loss_scale.update(applied)
        norm = self._apply(task, owned, float(summed[-1]) ** 0.5 / used, used) if applied else None
        for p in owned:
            p.grad = None
        comm_s, sent = self.clock.take()
        return StepOutcome(done=[StepResult(applied, total_stats)], comm_s=comm_s, sent_bytes=sent, grad_norm=norm)

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
            self.clock.seconds += time.perf_counter() - t0
        if task.scheduler is not None:
            task.scheduler.step()
        return torch.tensor(norm) if task.max_grad_norm is not None else None

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
        return state.state_without(task.model, self._foreign)

    def model_part(self, task: Task) -> dict[str, torch.Tensor]:
        """The weights this rank owns, by state_dict key."""
        return state.state_part(task.model, self._owns)

    def _owns(self, t: torch.Tensor) -> bool:
        return self.level == "full" and self.owner.get(id(t)) == self.rank

    def _foreign(self, t: torch.Tensor) -> bool:
        return self.level == "full" and self.owner.get(id(t), self.rank) != self.rank

    def state_bytes(self, task: Task) -> dict[str, int]:
        assert self.shard is not None
        return {"optimizer": self.shard.state_bytes(), "strategy": 0}

    def held_bytes(self, task: Task) -> int:
        """Bytes of weights this rank holds right now (between steps: what it owns, and what is not sliced)."""
        return units.held_bytes(task.model.parameters())

    # ---- measuring -----------------------------------------------------------------------------
    def measure_comm(self, task: Task, repeats: int) -> float:
        nbytes = self.exchange_bytes(task)

        def exchange() -> None:
            for unit in self.units:
                if self.level == "full":
                    self.gathers.gather(unit)
                    self.gathers.release(unit)
                    self.gathers.gather(unit)
                for _, _, params in unit.groups:
                    for p in params:
                        p.grad = None
                self.reduces.reduce(unit)
            self.reduces.acc.clear()

        seconds = exchange_seconds(exchange, all_reduce_probe, nbytes, repeats)
        self.clock.take()
        return seconds

    def exchange_bytes(self, task: Task) -> int:
        """Bytes a rank moves per step: gradients to their owners, and the weights twice (full: a gather for
        forward, one for backward) or once (gradients: the owners' broadcast after the step)."""
        weights = sum(storage_bytes(p) for unit in self.units for p in unit.params)
        return weights * (3 if self.level == "full" else 2)

    def close(self) -> None:
        """Hooks off, and every weight whole again (its values come from the state loaded next)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.gathers.make_whole(self.units)
        self.reduces.acc.clear()

    # ---- a user's own loop (train/_sliced_loop.py): it builds and steps its optimizer itself, after this -------
    def setup_loop(
        self, model: torch.nn.Module, ctx: JoinContext, blocks: Sequence[str | type[torch.nn.Module]] = ()
    ) -> None:
        """setup() before the loop's optimizer exists: owners by the model's trainable parameters in order, through
        a stand-in optimizer over them that never steps (the loop's own steps only what has a gradient: what this
        rank owns, see finish_backward)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        stand_in = torch.optim.SGD(trainable, lr=0.0)
        self.setup(
            Task(model=model, optimizer=stand_in, loss_fn=torch.nn.functional.mse_loss, shard_blocks=tuple(blocks)), ctx
        )

    def finish_backward(self) -> list[torch.nn.Parameter]:
        """A loop's backward has ended: the step's gradients to their owners (an owned .grad held before this
        backward rode along in the reduce: torch's accumulation). Returns the owned parameters."""
        return self.reduces.to_owners(self.units, self.owned)

    def global_grad_norm(self, owned: list[torch.nn.Parameter]) -> float:
        """The 2-norm of the whole gradient: the owners' squared sums, summed (one all-reduce)."""
        return float(self.reduces.sum_stats_and_squares(torch.zeros(0), owned)[-1]) ** 0.5

    def broadcast_owned(self) -> None:
        """gradients: every owner sends its updated weights to the others (the sliced optimizer's broadcast)."""
        assert self.shard is not None
        with self.clock.timed():
            self.shard.broadcast()
