"""Large transfers (checkpoints, final weights) stream in pieces: a slow link that keeps sending is waited on
however long the whole takes; a peer that stops sending is a lost worker after the stall timeout."""

import time

import pytest
import ray
import torch

from mixtrain import ScalingConfig
from mixtrain.cluster.placement import WorkerSpec
from mixtrain.comm import state_transfer
from mixtrain.group.membership import Member, Membership
from mixtrain.group.worker_calls import WorkerCalls
from mixtrain.group.worker_group import STREAM_AHEAD, WorkerGroup, WorkerTimeout

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
