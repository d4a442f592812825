"""Parameter-server shards: Ray actors that hold a slice of the parameters and their optimizer state.

The parameters are split over the shards by size (largest first, each to the lightest shard),
so no single actor carries the whole model's traffic. Every worker pushes, for each step, its
sample-weighted gradient for the shard's slice; when all of a step's gradients are in (and the
step before it is applied), the shard sums them in rank order, steps the user's optimizer and
scheduler on its slice and answers every waiting push with the new weights. That is the
all-reduce's math: the synchronous parameter server trains exactly like one device.

Bounded staleness is the workers' side: a worker does not wait for its own push's answer until
it would be more than S updates ahead of the newest weights it holds (`ps.py`).

Clipping (`Task.max_grad_norm`) needs the norm of the whole gradient, which no shard holds alone: once a
shard has summed a step, it publishes its slice's squared norm and asks every other shard for theirs
(`norm_part`), so all shards clip by the same global coefficient, as one device would.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from mixtrain._constants import COLLECTIVE_TIMEOUT_S, PS_START_TIMEOUT_S, env_float
from mixtrain.comm import replicas
from mixtrain.comm.compress import decode
from mixtrain.comm.state_transfer import Packed
from mixtrain.comm.store_pages import StorePages, two_steps
from mixtrain.devices import host_allocator
from mixtrain.task import Task, build_task

SHARD_BYTES = 16 * 2**20
"""shards="auto": one shard per this many bytes of trainable parameters, at most MAX_SHARDS."""
MAX_SHARDS = 4


def num_shards(requested: int | str, trainable_bytes: int) -> int:
    if requested != "auto":
        return int(requested)
    return max(1, min(MAX_SHARDS, math.ceil(trainable_bytes / SHARD_BYTES)))


def partition(sizes: list[int], shards: int) -> list[list[int]]:
    """Indices of `sizes` per shard: largest first, each to the shard with the fewest elements so
    far (ties to the lower shard); each shard's indices in ascending order. Deterministic, so the
    workers and the shards compute the same split."""
    loads = [0] * shards
    out: list[list[int]] = [[] for _ in range(shards)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(shards), key=lambda s: (loads[s], s))
        out[s].append(i)
        loads[s] += sizes[i]
    return [sorted(ix) for ix in out]


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> the parameter's number in optimizer.state_dict()."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {id(p): i for i, p in enumerate(params)}


def state_to_numpy(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        i: {k: v.detach().cpu().numpy() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in state.items()
    }


def state_from_numpy(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        int(i): {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in s.items()}
        for i, s in state.items()
    }


def gather_optimizer_state(servers: list[Any], timeout_s: float) -> dict[int, dict[str, Any]]:
    """Every shard's optimizer state, merged by the optimizer's parameter numbers and packed (state_transfer),
    for the driver: read in place from the object store, so no worker holds the state on its way."""
    try:
        parts = ray.get([s.optimizer_state.remote() for s in servers], timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
        raise RuntimeError(
            f"a parameter server did not hand over its optimizer state within {timeout_s:g} s ({type(exc).__name__}): "
            "the state lives only there, so this checkpoint cannot be written; the last one is intact, resume from it"
        ) from exc
    merged: dict[int, dict[str, Any]] = {}
    for part in parts:
        for i, entry in part.items():
            merged[int(i)] = {k: Packed(v, str(v.dtype)) if isinstance(v, np.ndarray) else v for k, v in entry.items()}
    return merged


@dataclass
class _Step:
    grads: dict[int, tuple[torch.Tensor, float, bool, np.ndarray]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: tuple | None = None


class ParameterServer:
    """One shard. All methods are coroutines: pushes for the same step wait together on one event."""

    def __init__(
        self,
        factory: Callable[[], Task],
        index: int,
        shards: int,
        seed: int,
        compress: str,
        collective_timeout_s: float,
    ) -> None:
        host_allocator.release_large_blocks()
        self.collective_timeout_s = collective_timeout_s  # the driver's (Tunables), not this process's environment
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.task = build_task(factory)
        self.task.model.to("cpu")
        params = trainable(self.task.model)
        self.owned = partition([p.numel() for p in params], shards)[index]
        self.params = [params[i] for i in self.owned]
        mine = {id(p) for p in self.params}
        with torch.no_grad():
            for p in params:  # the other shards' parameters are never stepped here: free their memory
                if id(p) not in mine:
                    p.data = torch.empty(0)
        index_of = optimizer_index(self.task.optimizer)
        self.opt_ids = [index_of[id(p)] for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.compress = compress
        self.world_size = 0
        self.version = 0
        self.steps: dict[int, _Step] = {}
        self.index = index
        self.peers: list[Any] = []
        """Every shard's actor handle, in shard order (set once all are started; clipping asks them)."""
        self._norm_parts: dict[int, float] = {}  # step -> this shard's squared gradient norm, once summed
        self._norm_ready: dict[int, asyncio.Event] = {}
        self._applying = asyncio.Lock()  # pushes arrive concurrently; updates are applied one at a time
        self._restore_point: dict[str, Any] | None = None  # this shard's state at the start of the round
        # every update reads each rank's gradient from the object store and writes the weights into it: the
        # pages touched go back once they pass two updates' worth (set when a group forms)
        self.store_pages = StorePages(0)

    def _form(self, world_size: int) -> None:
        """A group of `world_size` workers formed: pushes of an older group are voided, updates count from 0."""
        self._void_pending()
        self.world_size, self.version = world_size, 0
        self.store_pages.limit_bytes = two_steps((world_size + 1) * 4 * self.numel)  # the gradients, the weights

    def _void_pending(self) -> None:
        """Pushes still waiting belong to a group that is gone: answer them as void."""
        for step in self.steps.values():
            step.result = ("void",)
            step.done.set()
        self.steps = {}
        self._norm_parts, self._norm_ready = {}, {}

    async def load(
        self, world_size: int, weights: np.ndarray, opt_state: dict, param_groups: list, scheduler: Any
    ) -> int:
        """A group formed: start from rank 0's complete state; pushes of an older group are voided."""
        self._form(world_size)
        replicas.unflatten_into(decode(weights, "none"), self.params)
        sd = self.task.optimizer.state_dict()
        sd["state"] = state_from_numpy(opt_state)
        sd["param_groups"] = param_groups  # the same model and optimizer: the same parameter numbers
        self.task.optimizer.load_state_dict(sd)
        if scheduler is not None and self.task.scheduler is not None:
            self.task.scheduler.load_state_dict(scheduler)
        return self.numel

    async def reopen(self, world_size: int) -> np.ndarray:
        """A group re-formed around this shard's state (the truth between rounds): void older pushes,
        count updates from 0 again, and hand out the weights for the workers to start from."""
        self._form(world_size)
        return self._weights()

    async def mark(self) -> None:
        """A round starts: keep this shard's state (weights, optimizer, scheduler) to redo the round from
        if a worker is lost in it. One copy of the slice, here on the server, never on a worker's device."""
        self._restore_point = {
            "weights": replicas.flat_on_host(self.params).clone(),
            "optimizer": copy.deepcopy(self.task.optimizer.state_dict()),
            "scheduler": self.task.scheduler.state_dict() if self.task.scheduler is not None else None,
        }

    async def restore(self) -> None:
        """Back to the round's start (a worker was lost in it); idempotent, so every survivor may ask."""
        point = self._restore_point
        assert point is not None, "restore() before any mark()"
        self._void_pending()
        replicas.unflatten_into(point["weights"], self.params)
        self.task.optimizer.load_state_dict(copy.deepcopy(point["optimizer"]))
        if point["scheduler"] is not None and self.task.scheduler is not None:
            self.task.scheduler.load_state_dict(point["scheduler"])

    def _weights(self) -> np.ndarray:
        return replicas.flat_on_host(self.params).numpy()

    async def push(
        self, step: int, rank: int, grad: np.ndarray, scale: float, finite: bool, stats: np.ndarray
    ) -> tuple:
        """Rank `rank`'s gradient for global update `step`. Answers once that update is applied:
        (applied, summed stats, version, the shard's weights after it)."""
        if step < self.version:
            raise RuntimeError(f"push for update {step} after update {self.version - 1} was applied (a stale group)")
        entry = self.steps.setdefault(step, _Step())
        entry.grads[rank] = (decode(grad, self.compress), scale, finite, stats)
        async with self._applying:
            await self._apply_ready()
        await entry.done.wait()
        assert entry.result is not None
        if entry.result[0] == "void":
            raise RuntimeError("the group was re-formed while this push waited")
        return entry.result

    async def _apply_ready(self) -> None:
        while (entry := self.steps.get(self.version)) is not None and len(entry.grads) == self.world_size:
            contributions = [entry.grads[r] for r in sorted(entry.grads)]
            applied = all(finite for _, _, finite, _ in contributions)
            stats = np.sum([s for *_, s in contributions], axis=0)
            norm = None
            if applied:
                total = torch.zeros(self.numel)
                for grad, scale, _, _ in contributions:  # each rank's own loss scale comes off its own gradient
                    total.add_(grad, alpha=1.0 / scale)
                if self.task.max_grad_norm is not None:
                    norm = await self._clip(self.version, total, self.task.max_grad_norm)
                offset = 0
                for p in self.params:
                    p.grad = total[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                self.task.optimizer.step()
                if self.task.scheduler is not None:
                    self.task.scheduler.step()
            self.version += 1
            # One object with the new weights for every waiting push (they hold a reference, not a copy each):
            # the store holds the slice once a step, not once per worker, and the shard serialises it once.
            entry.result = (applied, stats, self.version, ray.put(self._weights()), norm)
            entry.done.set()
            del self.steps[self.version - 1]
            self.store_pages.release_if_over()

    async def _clip(self, step: int, total: torch.Tensor, max_norm: float) -> float:
        """Scale this shard's summed gradient as clip_grad_norm_ would scale the whole model's: by
        max_norm / (global norm + 1e-6), at most 1. Returns the global norm before clipping."""
        self._norm_parts[step] = float(total.double().pow(2).sum())
        self._ready(step).set()
        # a peer shard that never sums this step (its workers are gone) must not hold this one forever
        wait_s = self.collective_timeout_s
        parts = [
            self._norm_parts[step] if i == self.index else await asyncio.wait_for(peer.norm_part.remote(step), wait_s)
            for i, peer in enumerate(self.peers or [None])
        ]
        norm = math.sqrt(sum(parts))  # in shard order: the same float on every shard
        total.mul_(min(1.0, max_norm / (norm + 1e-6)))
        for old in [s for s in self._norm_parts if s < step - 1000]:  # peers ask for recent steps only
            del self._norm_parts[old], self._norm_ready[old]
        return norm

    def _ready(self, step: int) -> asyncio.Event:
        return self._norm_ready.setdefault(step, asyncio.Event())

    async def norm_part(self, step: int) -> float:
        """This shard's squared gradient norm of update `step`, once it has summed that update."""
        await self._ready(step).wait()
        return self._norm_parts[step]

    async def set_peers(self, peers: list[Any]) -> None:
        self.peers = list(peers)

    async def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """This shard's optimizer state (by the optimizer's parameter numbers), as numpy."""
        state = self.task.optimizer.state_dict()["state"]
        return state_to_numpy({i: state[i] for i in self.opt_ids if i in state})

    async def echo(self, grad: np.ndarray) -> Any:
        """A push's traffic without an update (the planner's measurement): the weights come back as a push's do."""
        decode(grad, self.compress)
        return ray.put(self._weights())

    async def ready(self) -> int:
        return self.numel


def start(
    factory: Callable[[], Task],
    shards: int,
    seed: int,
    compress: str,
    node_id: str | None,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """The shard actors, on `node_id` (default: the driver's node, normally the head). They reserve no
    CPU, so they never keep a worker from its bundle; each runs torch on one thread."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or ray.get_runtime_context().get_node_id()
    cls: Any = ray.remote(num_cpus=0, max_restarts=0)(ParameterServer)
    where = NodeAffinitySchedulingStrategy(node, soft=False)
    timeout_s = collective_timeout_s if collective_timeout_s is not None else env_float(COLLECTIVE_TIMEOUT_S)
    actors = [
        cls.options(scheduling_strategy=where).remote(factory, i, shards, seed, compress, timeout_s)
        for i in range(shards)
    ]
    wait_s = env_float(PS_START_TIMEOUT_S)
    try:
        ray.get([a.ready.remote() for a in actors], timeout=wait_s)
        ray.get([a.set_peers.remote(actors) for a in actors], timeout=wait_s)
    except ray.exceptions.GetTimeoutError:
        for actor in actors:
            ray.kill(actor)
        raise RuntimeError(
            f"the {shards} parameter-server actor(s) did not start within {wait_s:g} s "
            "(MIXTRAIN_PS_START_TIMEOUT_S): building the model there hung or the head node is out of memory; "
            "check the task factory, or raise the limit"
        ) from None
    return actors
