"""prepare_model and prepare_data_loader: a user's model and DataLoader, ready for a loop on mixtrain's workers.

The prepared model is DDP's counterpart (`.module`, `no_sync()`): its backward sums the gradients over the
workers, each weighted by its share of the step's global batch (comm/loop_grads.py), so `.grad` after `backward()`
is the gradient one process would compute on the whole global batch. The prepared loader keeps the user's dataset,
collate function, loader processes and pin_memory, and replaces the sampler by mixtrain's step-indexed one: the
global batch is the loader's batch_size times the number of workers the run asked for (Ray Train's meaning; it stays
so when a worker is lost), each epoch's seeded
permutation (or the dataset's order, without shuffle) cut into global batches, each split by the workers' shares.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)
from torch.utils.data.distributed import DistributedSampler

from mixtrain.comm import replicas
from mixtrain.comm.loop_grads import LoopGrads
from mixtrain.data.sampling import epoch_permutation, step_size
from mixtrain.data.sources import _Seeded, to_device
from mixtrain.devices import host_allocator
from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.policies.decisions import Adopt
from mixtrain.policies.planner import equal_shares, largest_remainder
from mixtrain.shard.blocks import check_named
from mixtrain.train._session import LoopSession
from mixtrain.train._sliced_loop import SlicedLoop, check_shard
from mixtrain.train._step_reads import DatasetReads, EpochCut, TensorReads


class PreparedModel(torch.nn.Module):
    """The user's model on this worker's device, its gradients exchanged during backward (`.module` is the model)."""

    def __init__(
        self, module: torch.nn.Module, session: LoopSession, shard: str = "none", slices: Any = None, blocks: Any = ()
    ) -> None:
        super().__init__()
        weights = check_shard(shard, slices, session.context.world_size, blocks)
        blocks = check_named(module, blocks, "prepare_model's blocks")  # on one worker too
        self.module = module.to(session.context.device)
        session.models.append(self.module)
        host_allocator.weights_are(*session.models)
        self.shard = shard
        self._session = session
        self._sync = True
        self._grads: LoopGrads | None = None
        self._sliced: SlicedLoop | None = None
        self._buffers_sync: list[torch.Tensor] = []
        if session.context.world_size > 1:
            replicas.broadcast_state(self.module)  # every replica starts from rank 0's weights (as DDP)
            self._buffers_sync = [b for b in self.module.buffers() if b.is_floating_point()]
            if shard != "none":  # the Task path's engine (shard/sliced.py), stepped by the loop's own optimizer
                self._sliced = SlicedLoop(self.module, session, shard, weights, blocks)  # type: ignore[arg-type]
                session.grads.append(self._sliced)
                return
            params = [p for p in self.module.parameters() if p.requires_grad]
            self._grads = LoopGrads(params, session.bucket_bytes, replicas.comm_device())
            self._grads.on_work = session.work_done
            session.grads.append(self._grads)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        exchanged = self._grads is not None or self._sliced is not None
        if exchanged and torch.is_grad_enabled():
            if self._sync and self._buffers_sync and self.training:
                replicas.broadcast_tensors(self._buffers_sync, 0)  # BatchNorm statistics are rank 0's (as DDP)
            if self._grads is not None:
                self._grads.before_forward(self._session.weight, self._sync)
        if self._sliced is not None and torch.is_grad_enabled():
            self._sliced.before_forward()
            return self._sliced.weigh(self.module(*args, **kwargs))
        with host_allocator.activations():  # as a Task's forward pass (worker/replica.py)
            return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the whole gradient to `max_norm` (torch.nn.utils.clip_grad_norm_ on every parameter, as FSDP's
        method of the same name); returns the norm before clipping. With shard=, torch's own function would see
        only this worker's slice: call this one (the 2-norm of the whole gradient, one all-reduce)."""
        if self._sliced is None:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        if norm_type != 2.0:
            raise InputValueError(f"clip_grad_norm_(norm_type={norm_type!r}) with shard=: only the 2-norm (2.0)")
        return self._sliced.clip_grad_norm_(max_norm)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Any]:
        """`self.module.state_dict()`, whole (with shard="full", each owner's weights gathered): what a checkpoint
        saves. Call it on every worker (it is a collective with shard="full"). `rank0_only=True`: the whole state
        on worker 0 alone, every other worker gets {} (as FSDP's full state dict with rank0_only): what a sliced
        model larger than one worker's memory needs."""
        if self._sliced is not None:
            return self._sliced.full_state_dict(self.module, rank0_only)
        return {} if rank0_only and self._session.context.world_rank != 0 else self.module.state_dict()

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = False) -> dict[str, Any]:
        """`optimizer.state_dict()`, whole (with shard=, each worker's slice gathered): what a checkpoint saves.
        Call it on every worker (it is a collective with shard=). `rank0_only=True`: on worker 0 alone ({} on the
        others)."""
        if self._sliced is not None:
            return self._sliced.full_optimizer_state_dict(optimizer, rank0_only)
        return {} if rank0_only and self._session.context.world_rank != 0 else optimizer.state_dict()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards in this block only accumulate (each weighted by its batch's share); the next backward outside
        it sums the lot over the workers, as DDP's no_sync(). With shard=, every backward still sends its
        gradients to their owners (no worker holds the whole gradient to accumulate into): the sum is the same."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before


class StepSampler:
    """What `loader.sampler` is after prepare_data_loader: `set_epoch(epoch)` picks the epoch whose order the next
    iteration takes (as DistributedSampler's). Without it, each iteration takes the next epoch (as a DataLoader
    with shuffle=True reshuffles at every pass)."""

    def __init__(self) -> None:
        self._next = 0
        self._set: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise InputValueError(f"sampler.set_epoch({epoch!r}): give the epoch, an integer >= 0")
        self._set = epoch

    def take_epoch(self) -> int:
        epoch = self._set if self._set is not None else self._next
        self._set, self._next = None, epoch + 1
        return epoch


_LOADER_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
)


class PreparedLoader:
    """A DataLoader's batches for this worker: its share of each step's global batch, on its device."""

    def __init__(self, loader: DataLoader, session: LoopSession, move_to_device: bool = True) -> None:
        _check_loader(loader)
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size or 0)  # (checked: not None)
        self.drop_last = loader.drop_last
        self.shuffle = _shuffles(loader)
        self.sampler = StepSampler()
        self._session = session
        self._move = move_to_device
        self._options = {k: getattr(loader, k) for k in _LOADER_OPTIONS}
        if loader.num_workers > 0:
            self._options["prefetch_factor"] = loader.prefetch_factor
        self._seeded = _Seeded(self.dataset, session.seed)
        self._global_batch = session.loader_global_batch(self.batch_size)
        self._reads: TensorReads | DatasetReads
        if isinstance(self.dataset, TensorDataset) and self._options["collate_fn"] is default_collate:
            self._reads = TensorReads(self.dataset.tensors)
        else:  # each sample's random streams seeded from (seed, epoch, index)
            self._reads = DatasetReads(self._seeded, self._options)

    @property
    def global_batch(self) -> int:
        """batch_size times the workers the run asked for (Ray Train's meaning), as the run's first attempt asked:
        the same after a worker is lost or left out, whatever the restarted loop asks (the math does not change with
        who is left)."""
        return self._global_batch

    def __len__(self) -> int:
        n, b = len(self.dataset), self.global_batch  # type: ignore[arg-type]
        return n // b if self.drop_last else -(-n // b)

    def __iter__(self) -> Iterator[Any]:
        """The epoch's batches for this worker. With shares="auto" the split is planned at the epoch's start and
        looked at again after steps 2, 4, 8, ... and every 128 steps: where the measured speeds have moved, the
        rest of the epoch is cut by the new shares (each step's samples are the same whatever the split), read by
        the same loader processes."""
        session, rank = self._session, self._session.context.world_rank
        epoch = self.sampler.take_epoch()
        num, total, batch = len(self.dataset), len(self), self.global_batch  # type: ignore[arg-type]
        order = epoch_permutation(session.seed, epoch, num) if self.shuffle else np.arange(num)
        shares = plan_shares(session, batch, at=(epoch, 0))
        if shares is None:
            session.end_epoch()
            return
        cut = EpochCut(order, batch, total, rank, shares)
        self._reads.start(epoch, cut)
        try:
            for t in range(total):
                session.share = cut.shares[rank]
                idx = cut.indices(t)
                read = self._reads.take(t, idx) if len(idx) else self._empty(epoch, order)
                session.begin_batch(len(idx), step_size(num, batch, t))
                yield to_device(read, session.context.device) if self._move else read
                if t + 1 < total and _plan_point(t + 1):
                    session.close_interval()  # the gather is no step's compute
                    moved = plan_shares(session, batch, cut.shares, (epoch, t + 1))
                    if moved is not None:
                        cut.move(moved)
        finally:
            self._reads.end()
            session.end_epoch()

    def _empty(self, epoch: int, order: np.ndarray) -> Any:
        """A batch of no samples, shaped as the others (the last step of an epoch may hold fewer samples than
        there are workers): its gradient counts for nothing, as its weight is 0."""
        one = self._options["collate_fn"]([self._seeded[(epoch, int(order[0]))]])
        return _slice_empty(one)


def _slice_empty(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _slice_empty(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice_empty(v) for v in batch)
    return batch


def _check_loader(loader: Any) -> None:
    if not isinstance(loader, DataLoader):
        raise InputTypeError(
            f"prepare_data_loader({type(loader).__name__}): give a torch.utils.data.DataLoader over a map-style "
            "Dataset, e.g. DataLoader(dataset, batch_size=32, shuffle=True)"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise InputValueError(
            "prepare_data_loader: the DataLoader reads an IterableDataset (a stream, e.g. Hugging Face "
            "streaming=True), whose samples cannot be indexed: mixtrain splits each step's samples by index to keep "
            "the math of one big batch. Use a map-style Dataset (datasets.load_dataset without streaming, or a "
            "Dataset with __len__ and __getitem__)"
        )
    if loader.batch_size is None:
        raise InputValueError(
            "prepare_data_loader: the DataLoader has a batch_sampler of its own (batch_size=None); give it "
            "batch_size=N and shuffle=True/False instead: mixtrain samples each step's global batch itself"
        )
    _check_sampler(loader.sampler)


def _check_sampler(sampler: Any) -> None:
    """mixtrain's sampler takes the place of the loader's: of a shuffle=True/False loader's own (RandomSampler over
    the whole set once, SequentialSampler) and of a torchrun script's DistributedSampler, whose order is the same
    kind. Any other (weighted, a subset, with replacement, a user's own) would be dropped with its order: refused."""
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return
    what = type(sampler).__name__
    if isinstance(sampler, RandomSampler):
        what += " with replacement=True or num_samples="
    raise InputValueError(
        f"prepare_data_loader: the DataLoader's sampler is a {what}, whose order mixtrain's sampler would replace "
        "(each step's global batch is a seeded permutation of the whole set with shuffle=True, the dataset's own "
        "order with shuffle=False). Give the DataLoader shuffle=True or False and no sampler; for a subset, a "
        "torch.utils.data.Subset(dataset, indices)"
    )


def _shuffles(loader: DataLoader) -> bool:
    """Whether the loader asked for a new order every epoch: shuffle=True, or a torchrun script's
    DistributedSampler, which shuffles unless told shuffle=False (whatever the DataLoader's own shuffle=False
    said). mixtrain's sampler takes its place either way."""
    if isinstance(loader.sampler, DistributedSampler):
        return bool(loader.sampler.shuffle)
    return not isinstance(loader.sampler, SequentialSampler)


def _plan_point(step: int) -> bool:
    """After which steps of an epoch the shares are looked at again: 2, 4, 8, ..., then every 128."""
    return step % 128 == 0 or (step >= 2 and step & (step - 1) == 0)


def plan_shares(
    session: LoopSession, global_batch: int, current: list[int] | None = None, at: tuple[int, int] = (0, 0)
) -> list[int] | None:
    """Each worker's samples of a global batch of `global_batch`: fixed (rescaled), equal, or (shares="auto") as
    the Task path's policy decides from each worker's measured speed (policies/decisions.Rebalancer: the shares move
    only past its imbalance threshold; a worker the job is faster without is voted on), the same on every worker
    (the figures are gathered). Within an epoch (`current`, the shares in force): the new shares, or None where
    they stay. `at`: (epoch, step) for the record in metrics.jsonl."""
    n, shares = session.context.world_size, session.shares
    if current is not None and (shares != "auto" or n == 1):
        return None
    if isinstance(shares, (list, tuple)):
        if len(shares) != n:
            raise InputValueError(f"ScalingConfig.shares={list(shares)}: {len(shares)} entries for {n} workers")
        return (
            list(shares) if sum(shares) == global_batch else largest_remainder([float(s) for s in shares], global_batch)
        )
    if shares == "equal" or n == 1:
        return equal_shares(global_batch, n)
    measured = session.gather(session.measured())
    speeds = [m[0] for m in measured]
    if min(speeds) <= 0:
        return None if current is not None else equal_shares(global_batch, n)  # nothing measured yet
    in_force = current or session.in_force.get(global_batch) or equal_shares(global_batch, n)
    rebalancer = session.rebalancer(global_batch)
    wall_s = max(m[2] for m in measured)
    decision = rebalancer.decide(
        speeds=speeds,
        step_compute_s=[s / v for s, v in zip(in_force, speeds)],
        shares=in_force,
        memory_caps=None,
        # the worker that waits least in the exchange is the slowest: its time there is the communication itself
        comm_s=min(m[1] for m in measured),
        # the job's samples/s by the wall clock, within an epoch once the loader's start-up is behind it
        measured_rate=global_batch / wall_s if current is not None and at[1] > 2 and wall_s > 0 else None,
    )
    planned = decision.plan.shares if isinstance(decision, Adopt) else in_force
    moved = current is None or planned != current
    session.in_force[global_batch] = planned
    told = session.leave_out_vote(decision, rebalancer.voting)
    if session.context.world_rank == 0 and (moved or told):
        record: dict[str, Any] = {"epoch": at[0], "step": at[1], "global_batch": global_batch, "shares": planned}
        record.update(speeds=speeds, moved=moved, **told)  # a leave-out named, withdrawn (None), or kept
        session.plan_to(record)
    return planned if moved else None
