"""Rank 0's store (TCPStore: no authentication) on real gloo ranks on 127.0.0.1: it listens on the address it was
given only, counts no key written without this formation's random prefix, and closes once the group has formed,
while the group's collectives, and the next formation, go on without it."""

import socket
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist

from mixtrain.comm.process_group import Rendezvous
from tests.distributed import ranks
from tests.distributed.ranks import run_ranks


def _listening(port: int) -> list[str]:
    """The addresses this process listens on at `port`."""
    conns = psutil.Process().net_connections(kind="tcp")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_the_store_listens_on_the_address_it_was_given_and_nowhere_else_and_closes():
    rendezvous = Rendezvous("127.0.0.1", 5)
    assert _listening(rendezvous.port) == ["127.0.0.1"]  # not 0.0.0.0 / :: (every interface)
    assert len(rendezvous.prefix) == 32 and rendezvous.prefix != Rendezvous("127.0.0.1", 5).prefix
    rendezvous.close()
    assert _listening(rendezvous.port) == []


def _collectives_then_store(rank, world):
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)  # done on any rank: every rank has formed the group, so rank 0 has closed its store
    dist.barrier()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=world - 1)
    try:
        socket.create_connection(ranks.STORE, timeout=5).close()
        store = "open"
    except ConnectionRefusedError:
        store = "closed"
    return {"sum": t.tolist(), "broadcast": b.tolist(), "store": store}


def test_the_store_closes_once_the_group_has_formed_and_the_group_and_the_next_formation_work_without_it():
    out = run_ranks(_collectives_then_store, 3, formations=2)
    for rank in range(3):
        status, formations = out[rank]
        assert status == "ok", formations
        for got in formations:
            assert got == {"sum": [6.0] * 3, "broadcast": [2.0, 2.0], "store": "closed"}, (rank, got)


def _noop(rank, world):
    return rank


def _write_the_fixed_key_names(port: int) -> None:
    """What anyone who reached the port could do before: announce every rank under the old fixed key names."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    for rank in range(2):
        store.set(f"mixtrain/arrived/{rank}", "1")


def test_keys_written_without_the_formations_prefix_do_not_count():
    # rank 1 never starts: an outsider's "arrived" keys must not stand in for it
    out = run_ranks(_noop, 2, timeout_s=3.0, ranks=[0], outsider=_write_the_fixed_key_names)
    status, message = out[0]
    assert status == "error" and "RendezvousError" in message, message
    assert "arrived/1" in message, message  # still waiting for rank 1 itself, not inside gloo's own set-up
