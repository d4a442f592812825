"""How replicas agree after each local backward pass.

The worker's step loop calls only `zero_grad`, `step` and `end_round`; a parameter server
or local SGD is another subclass here, with no change to the loop.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from mixtrain.comm import replicas
from mixtrain.comm.buckets import make_grad_buckets
from mixtrain.comm.compress import wire_dtype
from mixtrain.comm.link_measure import all_reduce_probe, exchange_seconds
from mixtrain.comm.state_transfer import unpack
from mixtrain.comm.step_gate import StepGate, as_user_built, can_gate
from mixtrain.comm.zero import ShardedOptimizer, split_runs
from mixtrain.config import StrategyConfig
from mixtrain.devices.precision import LossScale
from mixtrain.task import Task


@dataclass(frozen=True)
class StepResult:
    """The global outcome of one step, the same on every rank."""

    applied: bool
    """False when the summed gradient was not finite and the update was skipped everywhere."""
    stats: torch.Tensor
    """The per-step statistics summed over ranks (the global mean loss at index 0)."""
    grad_norm: torch.Tensor | float | None = None
    """For a result that arrives after its step (StepGate): the gradient's norm before clipping, when applied
    and the task clips."""


@dataclass(frozen=True)
class StepOutcome:
    done: list[StepResult]
    """Results of this rank's steps that became known during this call, oldest first: this step's for
    a synchronous strategy; none, or several earlier ones, for one that does not wait."""
    comm_s: float
    """Seconds spent communicating, including waiting for slower peers."""
    sent_bytes: int = 0
    """Bytes of gradients or deltas this rank sent for this step (the wire size)."""
    staleness: int = 0
    """How many updates the weights this step's gradient was computed on were behind the step."""
    grad_norm: torch.Tensor | float | None = None
    """The gradient's global L2 norm before clipping (None: the task does not clip); a tensor on the device is
    read when the round ends, so clipping costs no wait for the device per step."""


@dataclass(frozen=True)
class RoundSync:
    drift: float
    """Largest relative difference of a replica's parameter checksum from rank 0's."""
    rebroadcast: bool
    """True when drift passed the tolerance and rank 0's state was broadcast."""
    comm_s: float
    done: list[StepResult] = field(default_factory=list)
    """Results of steps still outstanding when the round's last step returned."""
    sent_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class JoinContext:
    """What a strategy is set up with when a group forms."""

    bucket_bytes: int
    loss_scaling: bool
    """fp16 somewhere in the job: the same on all ranks."""
    rank: int
    world_size: int
    timeout_s: float
    """How long to wait for peers or parameter servers before the round is given up as failed."""
    servers: tuple[Any, ...] = ()
    """The parameter-server actors (ps, ps-async)."""
    shard_weights: tuple[float, ...] | None = None
    """Per rank, the relative size of its slice of the optimizer state (None: every rank holds all of it)."""
    offload: bool = False
    """The optimizer's slice and an fp32 master copy of its weights live in host memory (ScalingConfig.offload)."""
    fresh_state: bool = True
    """The workers hold state the parameter servers do not have yet (the first formation, a resume):
    rank 0 loads the servers from it. False: the servers' state is the truth and the workers take it."""
    store_pages_bytes: int = 0
    """Parameter servers: the object store's pages a worker may hold before it hands them back (0: two steps'
    worth; MIXTRAIN_STORE_PAGES_MB)."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nest of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def clip_gradients(task: Task, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """Clip the (reduced, unscaled) gradient of `params` to the task's max_grad_norm; its norm before (a
    tensor on the device, read later). Every replica holds the same gradient here, so every replica clips it
    the same way."""
    if task.max_grad_norm is None:
        return None
    return torch.nn.utils.clip_grad_norm_(params, task.max_grad_norm).detach()


def small_state(task: Task, loss_scale: LossScale) -> dict[str, Any]:
    """The few scalars a step changes besides tensors (scheduler position, loss scale), copied: what a
    strategy keeps as its restore point instead of a second copy of the weights and optimizer state."""
    scheduler = task.scheduler.state_dict() if task.scheduler is not None else None
    return copy.deepcopy({"scheduler": scheduler, "loss_scale": loss_scale.state_dict()})


def load_small_state(task: Task, loss_scale: LossScale, state: dict[str, Any]) -> None:
    if task.scheduler is not None and state["scheduler"] is not None:
        task.scheduler.load_state_dict(state["scheduler"])
    loss_scale.load_state_dict(state["loss_scale"])


class SyncStrategy(ABC):
    """How replicas agree. Recovery from a lost peer needs no copy of the training state: a step is
    *committed* once every rank has its global result, and committed steps are the same on every replica
    that saw them. After a failed round each survivor calls `recover()` (back to its own last committed
    state) and reports how many steps it committed; the driver hands the most advanced survivor's state to
    those behind and the round goes on from there (`keeps_partial_rounds`), or, where shared state outside
    the workers cannot tell committed from not (parameter servers), the whole round is redone from the
    restore point taken in `begin_round`."""

    name: str
    loss_scale: LossScale = LossScale(enabled=False)
    """The job-wide loss scale (fp16); the worker multiplies each loss by `loss_scale.scale`."""
    keeps_partial_rounds: bool = True
    """After a failed round the steps committed so far stand; False: the round is redone from its start."""
    stats_on_device: bool = False
    """`step` takes the per-step statistics (the loss) on the worker's device; else on the CPU."""

    def __init__(self, config: StrategyConfig) -> None:
        self.config = config

    @abstractmethod
    def setup(self, task: Task, ctx: JoinContext) -> None:
        """Called each time the group forms: make every replica equal to rank 0's."""

    @abstractmethod
    def zero_grad(self, task: Task) -> None: ...

    def begin_round(self, task: Task) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before a round's first step (a strategy that redoes failed rounds takes its restore point)."""

    def flush(self, task: Task) -> list[StepResult]:
        """A round stopped part-way (a lost peer, out of memory): results of steps this replica has applied but
        not reported yet, so that they count as committed."""
        return []

    def recover(self, task: Task) -> None:  # noqa: B027 - all-reduce: committed steps are the replica's state
        """After a peer was lost mid-round, before leaving the group: make this replica its last committed
        state (undo local work no peer has seen)."""

    def optimizer_state(self, task: Task) -> dict[str, Any]:
        """The optimizer state_dict as one process stepping every parameter would hold it (for checkpoints
        and replacements). Under a sharded optimizer, this rank's entries only (`shards_optimizer`), and with
        parameter servers none (they hold it): the driver merges those in."""
        return as_user_built(task.optimizer, task.optimizer.state_dict())

    def load_optimizer_state(self, task: Task, state: dict[str, Any]) -> None:
        """Take a full optimizer state_dict (a checkpoint's, another replica's; packed or not), before setup()."""
        task.optimizer.load_state_dict(unpack(state, copy=True))

    @property
    def shards_optimizer(self) -> bool:
        """Each rank holds only its slice of the optimizer state."""
        return False

    slices_weights: bool = False
    """Each rank holds only its slice of the weights (shard="full"): `model_state` leaves the others' out."""
    lockstep: bool = False
    """Every rank must run as many forward and backward passes per step, and held-out batches (the passes call
    collectives: shard="gradients" and "full")."""

    def model_state(self, task: Task) -> dict[str, Any]:
        """The model's state_dict as this rank can give it (under sliced weights: None for those others own)."""
        return task.model.state_dict()

    def model_part(self, task: Task) -> dict[str, Any]:
        """The weights this rank alone holds, by state_dict key (sliced weights), for the driver to merge."""
        return {}

    def state_bytes(self, task: Task) -> dict[str, int]:
        """Bytes this replica holds besides weights and gradients: its optimizer state, and the strategy's
        own copies (local SGD's common point and outer momentum)."""
        return {"optimizer": tensor_bytes(task.optimizer.state), "strategy": 0}

    def inner_batch(self, global_batch: int, world_size: int) -> int | None:
        """Samples per optimizer step where the strategy steps on a batch of its own instead of once per global
        step (local SGD at per-device pace): the worker then calls `inner_step` each time that many samples'
        gradients are in, and after each step that `exchanges_after` marks. None: one update per global step."""
        return None

    def inner_step(self, task: Task, fraction: float) -> None:
        """Step on the gradient of the samples backwarded since the last inner step, `fraction` of an inner
        batch (each sample's loss was weighted 1 / inner batch)."""
        raise NotImplementedError(f"{self.name} takes one update per global step")

    def exchanges_after(self, num_steps: int) -> list[bool]:
        """Which of the next `num_steps` global steps end with an exchange (where every gradient must have gone
        into an inner step)."""
        return [True] * num_steps

    def before_last_backward(self, task: Task) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called before the backward of a step's last micro-batch (when gradients become final)."""

    @abstractmethod
    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        """After backward on this rank's samples (`weight`: their part of the step's samples, which the
        gradients are already multiplied by): agree on the update and apply it."""

    @abstractmethod
    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        """Between rounds: finish outstanding work, average buffers (weighted by `weight`, this rank's
        share) and check drift. Afterwards every replica holds the same complete training state."""

    @abstractmethod
    def measure_comm(self, task: Task, repeats: int) -> float:
        """Seconds one exchange takes with no compute in the way (for the planner)."""

    @abstractmethod
    def exchange_bytes(self, task: Task) -> int:
        """Bytes one rank sends per exchange."""

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own training state (local-sgd's outer momentum) for checkpoints and rollback."""
        return {}

    def rank_state(self, task: Task) -> dict[str, Any]:
        """What this replica holds that the others do not (local SGD: its inner optimizer's state, its error
        feedback), for a checkpoint to give back to the worker of the same rank: a resume then continues
        bit for bit. Empty where every replica holds the same (all-reduce, the parameter servers)."""
        return {}

    def load_rank_state(self, task: Task, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Take back what rank_state() returned, after setup() (the optimizer part is loaded before it)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Restore what state_dict() returned."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what setup() attached to the model, before the group is re-formed."""


class AllReduceStrategy(SyncStrategy):
    """Synchronous data parallel: sum of sample-weighted gradients over gloo, then the same step everywhere."""

    name = "allreduce"
    stats_on_device = True  # they ride in the gradients' staging copy (or, alone, never leave the device)

    def setup(self, task: Task, ctx: JoinContext) -> None:
        replicas.broadcast_state(task.model)
        self.params = params = [p for p in task.model.parameters() if p.requires_grad]
        # the loss rides along in a spare slot (at the wire precision when compressed)
        self.buckets = make_grad_buckets(
            params,
            ctx.bucket_bytes,
            num_extras=1,
            comm_device=replicas.comm_device(),
            wire_dtype=wire_dtype(self.config.compress),
        )
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)
        self.shard: ShardedOptimizer | None = None
        if ctx.shard_weights is not None:
            sizes = [p.numel() for g in task.optimizer.param_groups for p in g["params"]]
            self.shard = ShardedOptimizer(
                task.optimizer, split_runs(sizes, ctx.shard_weights), ctx.rank, offload=ctx.offload
            )
            task.optimizer.state.clear()  # the user's optimizer only carries hyperparameters from now on
            if self._pending_optimizer is not None:
                self.shard.load_full(self._pending_optimizer)
        elif self._pending_optimizer is not None:
            task.optimizer.load_state_dict(unpack(self._pending_optimizer, copy=True))
        self._pending_optimizer = None
        # alone on a GPU, a step's "all finite?" verdict is read one step late and the update skipped on the device
        self.gate: StepGate | None = None
        device = params[0].device if params else torch.device("cpu")
        if ctx.world_size == 1 and device.type == "cuda" and not ctx.loss_scaling and self.shard is None:
            if can_gate(task.optimizer, device):
                self.gate = StepGate(task.optimizer, device)

    _pending_optimizer: dict[str, Any] | None = None
    gate: StepGate | None = None

    def load_optimizer_state(self, task: Task, state: dict[str, Any]) -> None:
        self._pending_optimizer = state  # setup() knows whether this rank keeps all of it or a slice

    @property
    def shards_optimizer(self) -> bool:
        return self.shard is not None

    def state_bytes(self, task: Task) -> dict[str, int]:
        if self.shard is None:
            return super().state_bytes(task)
        return {"optimizer": self.shard.state_bytes(), "strategy": 0}

    def optimizer_state(self, task: Task) -> dict[str, Any]:
        if self.shard is None:
            return as_user_built(task.optimizer, task.optimizer.state_dict())
        sd = task.optimizer.state_dict()  # the hyperparameters, as the scheduler left them
        sd["state"] = self.shard.state_part()
        return sd

    def zero_grad(self, task: Task) -> None:
        self.buckets.zero_()

    def before_last_backward(self, task: Task) -> None:
        self.buckets.arm()  # earlier micro-batches only accumulate; this one may start the all-reduce

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        t0 = time.perf_counter()
        stats = self.buckets.all_reduce_(local_stats)
        assert stats is not None
        comm_s = time.perf_counter() - t0
        if self.gate is not None:  # this step's result arrives with the next step's (or the round's end)
            grads = [p.grad for p in self.params if p.grad is not None]
            self.gate.step(task, grads, stats, lambda: clip_gradients(task, self.params))
            return StepOutcome(done=self._settled(), comm_s=comm_s)
        applied = self.buckets.all_finite(stats)
        used = self.loss_scale.scale
        self.loss_scale.update(applied)  # the same verdict on every rank keeps the scales equal
        norm = None
        if applied:
            if used != 1.0:
                self.buckets.scale_(1.0 / used)  # unscale first: the norm is the true gradient's
            norm = clip_gradients(task, self.params)
            if self.shard is not None:
                t1 = time.perf_counter()
                self.shard.step()  # this rank's slice, then every slice to every rank
                comm_s += time.perf_counter() - t1
            else:
                task.optimizer.step()
            if task.scheduler is not None:
                task.scheduler.step()
        return StepOutcome(
            done=[StepResult(applied, stats)], comm_s=comm_s, sent_bytes=self.buckets.wire_bytes, grad_norm=norm
        )

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        done = self.flush(task)
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        return RoundSync(d, rebroadcast, time.perf_counter() - t0, done=done)

    def flush(self, task: Task) -> list[StepResult]:
        if self.gate is None:
            return []
        self.gate.settle(task)
        return self._settled()

    def _settled(self) -> list[StepResult]:
        assert self.gate is not None
        return [StepResult(applied, stats, norm) for applied, stats, norm in self.gate.drain()]

    def measure_comm(self, task: Task, repeats: int) -> float:
        def exchange() -> None:
            self.buckets.zero_()
            self.buckets.all_reduce_(torch.zeros(self.buckets.num_extras))

        seconds = exchange_seconds(exchange, all_reduce_probe, self.buckets.wire_bytes, repeats)
        self.buckets.zero_()
        return seconds

    def exchange_bytes(self, task: Task) -> int:
        return self.buckets.wire_bytes

    def close(self) -> None:
        self.buckets.close()
