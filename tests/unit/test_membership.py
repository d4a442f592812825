"""Membership.nearest: which replica the driver reads a checkpoint or the final model from."""

from __future__ import annotations

from dataclasses import replace

from mixtrain.group.membership import Membership, Status
from tests.unit.test_controller import member


def on(node: str, rank: int):
    m = member(rank)
    assert m.info is not None
    m.info = replace(m.info, node_id=node)
    return m


def test_the_first_replica_on_the_drivers_node_is_read_and_rank_0_where_none_is():
    laptop_first = Membership([on("laptop", 0), on("desktop", 1), on("desktop", 2)])
    assert laptop_first.nearest("desktop") == 1  # the driver runs on the desktop: its first worker
    assert laptop_first.nearest("laptop") == 0
    assert laptop_first.nearest("elsewhere") == 0  # a driver with no worker of its own (a head-only node)


def test_ranks_follow_the_active_members_only():
    members = [on("laptop", 0), on("desktop", 1), on("desktop", 2)]
    members[1].status = Status.GONE  # lost: the ranks renumber among those still in
    assert Membership(members).nearest("desktop") == 1  # the third member, now rank 1
