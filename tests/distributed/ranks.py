"""Run a function on N real processes joined in a gloo group on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from mixtrain.comm import process_group

STORE: tuple[str, int] | None = None
"""In a rank's process, while `fn` runs: (host, port) of the store its group was formed through."""


def _entry(fn, rank, world, port_q, out_q, outsider_q, timeout_s, formations, args):
    global STORE
    try:
        import torch

        torch.set_num_threads(1)
        values = []
        for formation in range(formations):
            rdv = None
            if rank == 0:
                rdv = process_group.Rendezvous("127.0.0.1", timeout_s)
                for q in [port_q] * (world - 1) + [outsider_q] * (formation == 0):
                    q.put((rdv.port, rdv.prefix))
                port, prefix = rdv.port, rdv.prefix
            else:
                port, prefix = port_q.get(timeout=60)
            process_group.join_group(
                rank=rank,
                world_size=world,
                host="127.0.0.1",
                port=port,
                prefix=prefix,
                rendezvous_timeout_s=timeout_s,
                collective_timeout_s=timeout_s,
                rendezvous=rdv,
            )
            STORE = ("127.0.0.1", port)
            values.append(fn(rank, world, *args))
            process_group.leave_group()
        # plain pickle bytes: a queued tensor would be a shared-memory handle that dies with this process
        out_q.put((rank, "ok", pickle.dumps(values[0] if formations == 1 else values)))
    except BaseException as exc:  # report, never hang the parent
        out_q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 60.0,
    ranks: list[int] | None = None,
    formations: int = 1,
    outsider: Callable[[int], None] | None = None,
) -> dict[int, tuple[str, Any]]:
    """Start `ranks` (all by default) of a `world`-sized group; return {rank: (status, value)}. `formations`:
    form the group that many times (a new store each), calling `fn` in each; the value is then the list of
    their results. `outsider(port)`: called here with the first store's port, as soon as rank 0 opened it."""
    ctx = mp.get_context("spawn")
    port_q, out_q, outsider_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    ranks = list(range(world)) if ranks is None else ranks
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port_q, out_q, outsider_q, timeout_s, formations, args))
        for r in ranks
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        if outsider is not None:
            outsider(outsider_q.get(timeout=60)[0])
        for _ in ranks:
            rank, status, value = out_q.get(timeout=timeout_s * formations + 60)
            results[rank] = (status, pickle.loads(value) if status == "ok" else value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results
