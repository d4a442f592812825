"""Parameter-server strategies, the workers' side: `ps` (synchronous) and `ps-async` (bounded staleness).

Per step a worker sends each shard its slice of the sample-weighted gradient (at the wire
precision) through Ray's object store as numpy buffers, and gets back a reference to the shard's
weights after the update: one object per update that every worker reads, not a copy per worker.
Only trainable parameters travel; buffers (BatchNorm statistics) stay on the workers and are
averaged at round ends as with all-reduce.

Staleness rule (documented in docs/strategies-and-slow-links.md): the gradient of update t may be computed on weights
at most S updates old (version >= t - S). A worker waits before a step only when it would break
that bound, so a fast worker runs up to S updates ahead and never waits longer for a slow one.
Within the bound every gradient is applied at full weight; a gradient that arrives after its
update was applied (possible only from a group that was re-formed meanwhile) is rejected by the
shard. S = 0 is the synchronous parameter server.

The optimizer state lives on the shards only: a worker holds weights and gradients, and the driver
takes the state from the shards for a checkpoint; a replacement starts from the shards as every
worker does. At a round end every worker drains its pushes, so every replica holds the same weights.
The shards are loaded from rank 0 when the workers hold newer state (the first formation, a resume);
a group re-formed later starts from the shards' weights. At each round start rank 0 has the shards keep a restore
point; when a worker is lost mid-round the survivors put the shards back to it and the round
is redone (a shard cannot tell a committed update from one a dead worker half-pushed).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist

from mixtrain.comm import process_group, replicas
from mixtrain.comm.buckets import bind_grad_views, grad_views
from mixtrain.comm.compress import decode, encode, wire_dtype
from mixtrain.comm.link_measure import median_seconds
from mixtrain.comm.ps_server import optimizer_index, partition, state_to_numpy, trainable
from mixtrain.comm.store_pages import StorePages, two_steps
from mixtrain.comm.strategy import (
    JoinContext,
    RoundSync,
    StepOutcome,
    StepResult,
    SyncStrategy,
    load_small_state,
    small_state,
)
from mixtrain.devices.precision import LossScale
from mixtrain.task import Task


def _grad_buffer(group: list[torch.nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """For a group of fp32 CPU parameters: one flat buffer their gradients are views into (as DDP's
    gradient_as_bucket_view), which a push sends as it is: no copy of the gradients per step, and no new ones
    allocated by every backward. None for parameters elsewhere (a GPU's): copied to the host each step."""
    if not group or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in group):
        return None
    flat = torch.zeros(sum(p.numel() for p in group))
    return flat, grad_views(group, flat)


class ParameterServerStrategy(SyncStrategy):
    name = "ps"
    keeps_partial_rounds = False

    def setup(self, task: Task, ctx: JoinContext) -> None:
        if not ctx.servers:
            raise RuntimeError(f"strategy {self.config.name!r} needs parameter servers; none were started")
        self.servers = list(ctx.servers)
        self.timeout_s = ctx.timeout_s
        self.rank = ctx.rank
        self.staleness = self.config.ps.staleness if self.config.name == "ps-async" else 0
        self.loss_scale = LossScale(enabled=ctx.loss_scaling)
        self.grad_norm: float | None = None
        params = trainable(task.model)
        self.slices = [[params[i] for i in ix] for ix in partition([p.numel() for p in params], len(self.servers))]
        self.grad_buffers = [_grad_buffer(group) for group in self.slices]
        index_of = optimizer_index(task.optimizer)
        self.opt_ids = [[index_of[id(p)] for p in group] for group in self.slices]
        self.next_step = 0  # the update this worker's next gradient is for
        self.version = 0  # the update count of the weights this replica holds
        self.pending: deque[tuple[int, list[Any]]] = deque()
        self._round_start: dict[str, Any] = {}
        # each step writes this replica's gradients into the object store and reads its weights back: the
        # pages it touched go back once they pass two steps' worth
        self.store_pages = StorePages(ctx.store_pages_bytes or two_steps(4 * sum(p.numel() for p in params)))
        if ctx.rank == 0 and ctx.fresh_state:
            self._load_servers(task, ctx.world_size)
        elif ctx.rank == 0:
            answers = self._get([s.reopen.remote(ctx.world_size) for s in self.servers])
            for group, weights in zip(self.slices, answers):
                replicas.unflatten_into(decode(weights, "none"), group)
        replicas.broadcast_state(task.model)  # rank 0's weights (and buffers) to every replica
        task.optimizer.state.clear()  # the state lives on the shards; checkpoints gather it from there
        dist.barrier()  # no rank pushes before the shards are ready

    def _load_servers(self, task: Task, world_size: int) -> None:
        sd = task.optimizer.state_dict()
        scheduler = task.scheduler.state_dict() if task.scheduler is not None else None
        refs = []
        for server, group, ids in zip(self.servers, self.slices, self.opt_ids):
            weights = self._flat(group).numpy()
            state = state_to_numpy({i: sd["state"][i] for i in ids if i in sd["state"]})
            refs.append(server.load.remote(world_size, weights, state, sd["param_groups"], scheduler))
        self._get(refs)

    def _get(self, refs: list[Any]) -> list[Any]:
        """The answers, or PeerLostError when the shards do not answer in time: a sync update waits for
        every rank's gradient, so a dead or stopped peer shows up here."""
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise process_group.PeerLostError(
                f"Timed out waiting {self.timeout_s:.0f} s for the parameter servers: a peer died or stopped answering"
            ) from None

    @staticmethod
    def _flat(group: list[torch.nn.Parameter], grads: bool = False) -> torch.Tensor:
        """The group's weights (or gradients, zeros where a parameter got none) as one fp32 CPU buffer."""
        tensors = [(p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p for p in group]
        return replicas.flat_on_host(tensors, torch.float32)

    def zero_grad(self, task: Task) -> None:
        for group, buffer in zip(self.slices, self.grad_buffers):
            if buffer is None:
                for p in group:
                    p.grad = None
            else:
                flat, views = buffer
                bind_grad_views(group, views)
                flat.zero_()

    def _grads(
        self, group: list[torch.nn.Parameter], buffer: tuple[torch.Tensor, list[torch.Tensor]] | None
    ) -> torch.Tensor:
        """The group's gradient as one fp32 CPU buffer: its own flat buffer where it has one (a .grad that user
        code replaced is copied in first), else a copy."""
        if buffer is None:
            return self._flat(group, grads=True)
        flat, views = buffer
        bind_grad_views(group, views)
        return flat

    def begin_round(self, task: Task) -> None:
        # Rank 0's mark reaches each shard before rank 0's first push of the round, and no update of the
        # round can be applied without that push: every shard marks the state the round starts from.
        if self.rank == 0:
            self._get([s.mark.remote() for s in self.servers])
        self._round_start = small_state(task, self.loss_scale)

    def recover(self, task: Task) -> None:
        self._get([s.restore.remote() for s in self.servers])  # idempotent: every survivor may ask
        load_small_state(task, self.loss_scale, self._round_start)
        self.pending.clear()

    def optimizer_state(self, task: Task) -> dict[str, Any]:
        """param_groups only (the local scheduler keeps lr in step): the state itself lives on the shards, and
        the driver takes it from there (ps_server.gather_optimizer_state), never through this worker."""
        return task.optimizer.state_dict()

    def step(self, task: Task, local_stats: torch.Tensor, weight: float) -> StepOutcome:
        t0 = time.perf_counter()
        grads = [self._grads(group, buffer) for group, buffer in zip(self.slices, self.grad_buffers)]
        finite = all(bool(torch.isfinite(g).all()) for g in grads) and bool(torch.isfinite(local_stats).all())
        stats = local_stats.float().numpy()
        scale = self.loss_scale.scale
        step = self.next_step
        staleness = step - self.version
        refs = []
        sent = 0
        for server, g in zip(self.servers, grads):
            wire = encode(g, self.config.compress)
            sent += wire.nbytes
            refs.append(server.push.remote(step, self.rank, wire, scale, finite, stats))
        self.pending.append((step, refs))
        self.next_step += 1
        self.grad_norm = None
        done = self._collect(task, must_have=self.next_step - self.staleness)
        self.store_pages.release_if_over()
        return StepOutcome(
            done=done,
            comm_s=time.perf_counter() - t0,
            sent_bytes=sent,
            staleness=staleness,
            grad_norm=self.grad_norm,
        )

    def _collect(self, task: Task, must_have: int) -> list[StepResult]:
        """Take in answered pushes, oldest first: wait for those needed to hold weights of at least
        version `must_have`, take the others only if they are already answered."""
        done = []
        latest = None  # the newest answers: their weights are the only ones worth copying in
        while self.pending:
            step, refs = self.pending[0]
            if step >= must_have:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                if len(ready) < len(refs):
                    break
            answers = latest = self._get(refs)
            self.pending.popleft()
            applied = bool(answers[0][0])
            self.version = int(answers[0][2])
            self.loss_scale.update(applied)  # every rank sees the same verdicts in the same order
            if applied and task.scheduler is not None:
                task.scheduler.step()  # the local copy follows the shards' (for checkpoints)
            done.append(StepResult(applied, torch.from_numpy(np.asarray(answers[0][1]).copy())))
            self.grad_norm = answers[0][4]  # the global norm before clipping (None: the task does not clip)
        if latest is not None:  # each shard's weights after the newest update: one object its pushes share
            for group, weights in zip(self.slices, self._get([answer[3] for answer in latest])):
                replicas.unflatten_into(decode(weights, "none"), group)
        return done

    def end_round(self, task: Task, weight: float, drift_tolerance: float) -> RoundSync:
        t0 = time.perf_counter()
        done = self._collect(task, must_have=self.next_step)
        self.store_pages.release_if_over()
        replicas.average_buffers(task.model, weight)
        d, rebroadcast = replicas.resync_if_drifted(task.model, task.optimizer, drift_tolerance)
        return RoundSync(drift=d, rebroadcast=rebroadcast, comm_s=time.perf_counter() - t0, done=done)

    def measure_comm(self, task: Task, repeats: int) -> float:
        wires = [encode(self._flat(group), self.config.compress) for group in self.slices]
        return median_seconds(
            lambda: self._get(self._get([s.echo.remote(w) for s, w in zip(self.servers, wires)])), repeats
        )

    def exchange_bytes(self, task: Task) -> int:
        itemsize = (wire_dtype(self.config.compress) or torch.float32).itemsize
        return itemsize * sum(p.numel() for group in self.slices for p in group)
