"""A lost NCCL peer must reach mixtrain as a Python exception (the worker rolls back and rejoins), not as the
NCCL watchdog ending the process. This torch has no NCCL (CPU build): what is checked here is that the
settings are in the environment before the NCCL group is created; the GPU check (gpu/steps.py lost-worker)
loses a worker on a real GPU."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from mixtrain.comm.process_group import Rendezvous, RendezvousError, join_group


def test_joining_an_nccl_group_sets_errors_to_be_raised_not_to_end_the_process(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # torch's default: end the process
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    rendezvous = Rendezvous("127.0.0.1", 5)
    try:
        join_group(
            rank=0,
            world_size=1,
            host="127.0.0.1",
            port=rendezvous.port,
            prefix=rendezvous.prefix,
            rendezvous_timeout_s=5,
            collective_timeout_s=5,
            backend="nccl",
            rendezvous=rendezvous,
        )
    except RendezvousError:
        assert not dist.is_nccl_available()  # only a torch without NCCL may refuse
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"


def test_a_gloo_group_leaves_the_nccl_settings_alone(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    rendezvous = Rendezvous("127.0.0.1", 5)
    join_group(
        rank=0,
        world_size=1,
        host="127.0.0.1",
        port=rendezvous.port,
        prefix=rendezvous.prefix,
        rendezvous_timeout_s=5,
        collective_timeout_s=5,
        rendezvous=rendezvous,
    )
    dist.destroy_process_group()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


@pytest.mark.parametrize(
    "text", ["NCCL communicator was aborted on rank 0", "Watchdog caught collective operation timeout"]
)
def test_nccl_failures_count_as_a_lost_peer(text):
    from mixtrain.comm.process_group import is_peer_failure

    assert is_peer_failure(dist.DistBackendError(text))


@pytest.mark.parametrize(
    "exc,silent",
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation"), True),
        (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE)"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:4778: Connection reset by peer"), False),
        (RuntimeError("[gloo/transport/tcp/pair.cc:589] Connection closed by peer [10.0.0.2]:4778"), False),
    ],
)
def test_a_timed_out_collective_is_a_silent_peer_and_a_closed_connection_is_not(exc, silent):
    # the driver gives the others only a short grace after a timeout (the silent peer had the whole timeout);
    # after a closed connection (a peer died or left after running out of memory) they may still be computing
    from mixtrain.comm.process_group import PeerLostError, is_peer_failure, is_peer_silence

    assert is_peer_failure(exc) and is_peer_silence(exc) is silent
    assert is_peer_silence(PeerLostError("the parameter server waited 60 s for worker 1's gradient"))
