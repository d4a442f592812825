"""Large transfers (checkpoints, final weights) stream in pieces: a slow link that keeps sending is waited on
however long the whole takes; a peer that stops sending is a lost worker after the stall timeout."""

import time
from pathlib import Path

import pytest
import ray
import torch

from mixtrain import ScalingConfig, StrategyConfig
from mixtrain.cluster.placement import WorkerSpec
from mixtrain.comm import state_transfer
from mixtrain.group.group_ops import GroupOps
from mixtrain.group.membership import Member, Membership
from mixtrain.group.worker_calls import WorkerCalls
from mixtrain.group.worker_group import STREAM_AHEAD, WorkerGroup, WorkerTimeout
from mixtrain.worker.replica import TrainWorker

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class SlowSender:
    """Sends a 1 MB state as a worker would, pausing `pause_s` between pieces (a slow link), or going
    silent for `silent_s` half-way (a laptop asleep)."""

    def __init__(self, pause_s: float, silent_s: float = 0.0) -> None:
        self.pause_s, self.silent_s = pause_s, silent_s

    def stream_training_state(self):
        pieces = list(state_transfer.stream({"model": {"w": torch.arange(2**18, dtype=torch.float32)}}))
        for i, piece in enumerate(pieces):
            if i == len(pieces) // 2:
                time.sleep(self.silent_s)
            time.sleep(self.pause_s)
            yield piece


def group_of(actor) -> WorkerGroup:
    ray.get(actor.__ray_ready__.remote())  # started, as a worker is by the time it checkpoints
    group = WorkerGroup(ScalingConfig(num_workers=1), seed=0)
    spec = WorkerSpec(rank=0, device="cpu", bundle={"CPU": 1.0}, label_selector={}, threads=1, precision="fp32")
    group.members = Membership([Member(worker=WorkerCalls(actor), spec=spec)])
    return group


def test_a_transfer_slower_than_the_stall_timeout_in_total_still_arrives():
    # 18 pieces 0.2 s apart: 3.6 s in all, against a stall timeout of 1 s
    t0 = time.monotonic()
    state = group_of(SlowSender.remote(0.2)).receive(0, WorkerCalls.stream_training_state, stall_s=1.0)
    assert time.monotonic() - t0 > 3.0
    assert torch.equal(state_transfer.unpack(state)["model"]["w"], torch.arange(2**18, dtype=torch.float32))


def test_a_sender_that_goes_silent_is_a_timeout_naming_it():
    with pytest.raises(WorkerTimeout) as err:
        group_of(SlowSender.remote(0.0, silent_s=5.0)).receive(0, WorkerCalls.stream_training_state, stall_s=1.0)
    assert err.value.ranks == [0] and "sent nothing of training_state for 1 s" in str(err.value)


@ray.remote(num_cpus=0, max_concurrency=2)  # a second thread answers `sent` while the stream waits
class CountingSender:
    """Streams a 32 MB state (512 pieces) and counts the pieces it has produced."""

    def __init__(self) -> None:
        self.produced = 0

    def stream_training_state(self):
        for piece in state_transfer.stream({"w": torch.ones(2**23)}):
            self.produced += 1
            yield piece

    def sent(self) -> int:
        return self.produced


def test_a_sender_runs_only_a_few_pieces_ahead_of_the_reader():
    # Unbounded, a worker would produce the whole state at once and hold what the driver has not read yet
    sender = CountingSender.remote()
    gen = WorkerCalls(sender).stream_training_state(STREAM_AHEAD)
    deadline = time.monotonic() + 30
    while ray.get(sender.sent.remote()) < STREAM_AHEAD and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # room to run further ahead, were it unbounded
    ahead = ray.get(sender.sent.remote())
    assert STREAM_AHEAD <= ahead <= STREAM_AHEAD + 2, ahead  # of 513 pieces (the skeleton first)

    def pieces():
        for ref in gen:
            yield ray.get(ref)

    assert torch.equal(state_transfer.unpack(state_transfer.receive(pieces()))["w"], torch.ones(2**23))


class _InnerOptimizer:
    """A local-SGD strategy as far as a checkpoint asks it: this rank's own inner optimizer state (32 MB)."""

    def rank_state(self, task):
        return {"optimizer": {"state": {0: {"exp_avg": torch.full((2**23,), float(task))}}}}


@ray.remote(num_cpus=0)
class RankStateHolder:
    """TrainWorker's own stream_rank_state over a 32 MB inner optimizer state, and the process's shared pages."""

    stream_rank_state = TrainWorker.stream_rank_state

    def __init__(self, rank: int) -> None:
        self.strategy, self.task = _InnerOptimizer(), rank

    def shmem_mb(self) -> float:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssShmem:"))) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssShmem (Linux)")
def test_each_ranks_own_state_streams_to_the_checkpoint_and_leaves_no_store_pages_behind():
    # Returned whole, a local-SGD worker's inner optimizer state went through the object store at every checkpoint,
    # and the store's pages it wrote stayed in its resident memory: 2 x 95 MB per worker on a 12.6M AdamW model
    holders = [RankStateHolder.remote(r) for r in range(2)]
    group = group_of(holders[0])
    spec = WorkerSpec(rank=1, device="cpu", bundle={"CPU": 1.0}, label_selector={}, threads=1, precision="fp32")
    ray.get(holders[1].__ray_ready__.remote())
    group.members = Membership([*group.members, Member(worker=WorkerCalls(holders[1]), spec=spec)])
    ops = GroupOps(
        group,
        strategy=StrategyConfig(name="local-sgd"),
        backend="gloo",
        loss_scaling=False,
        data_refs=(None, None),
        task_factory=lambda: None,
    )
    before = ray.get([h.shmem_mb.remote() for h in holders])
    states = ops.rank_states()
    after = ray.get([h.shmem_mb.remote() for h in holders])
    for rank, state in enumerate(states):
        assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], torch.full((2**23,), float(rank)))
    assert all(a - b < 8 for a, b in zip(after, before, strict=True)), (before, after)
