"""Run a function on N real processes joined in a gloo group on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from mixtrain.comm import process_group


def _entry(fn, rank, world, port_q, out_q, timeout_s, args):
    try:
        import torch

        torch.set_num_threads(1)
        store = None
        if rank == 0:
            rdv = process_group.Rendezvous("127.0.0.1", timeout_s)
            store = rdv.store
            for _ in range(world - 1):
                port_q.put(rdv.port)
            port = rdv.port
        else:
            port = port_q.get(timeout=30)
        process_group.join_group(
            rank=rank,
            world_size=world,
            host="127.0.0.1",
            port=port,
            rendezvous_timeout_s=timeout_s,
            collective_timeout_s=timeout_s,
            store=store,
        )
        # plain pickle bytes: a queued tensor would be a shared-memory handle that dies with this process
        out_q.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
        process_group.leave_group()
    except BaseException as exc:  # report, never hang the parent
        out_q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 20.0, ranks: list[int] | None = None
) -> dict[int, tuple[str, Any]]:
    """Start `ranks` (all by default) of a `world`-sized group; return {rank: (status, value)}."""
    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    ranks = list(range(world)) if ranks is None else ranks
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port_q, out_q, timeout_s, args)) for r in ranks]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in ranks:
            rank, status, value = out_q.get(timeout=timeout_s + 60)
            results[rank] = (status, pickle.loads(value) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results
