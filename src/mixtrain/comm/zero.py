"""Optimizer state sharded across unequal devices (ZeRO stage 1, sized by memory).

Every worker still holds the whole model and, after the all-reduce, the whole summed gradient.
The optimizer state (AdamW's two moments: twice the weights) is what a small device cannot
hold, so each worker keeps it for one contiguous run of the parameters only, its length set
by the worker's weight (its free memory, or the user's figures): a 12 GB card takes more of
it than an 8 GB MacBook. After the exchange each worker steps its own run with a private
copy of the user's optimizer, then every owner broadcasts its updated run to the others.

The math is the unsharded optimizer's: AdamW, SGD, Adam, ... update each parameter from its
own gradient and state alone, so stepping a subset of the parameters changes nothing about
them. The user's optimizer object stays the one the LR scheduler sees: before each step its
groups' hyperparameters (lr, betas, weight decay) are copied into the shard's groups; it never
steps and holds no state itself.

Parameters are assigned whole, in order: a run is `params[lo:hi]`, so the parameter numbers of
the user's optimizer stay valid keys for checkpoints and a different split can load them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from mixtrain.comm import replicas
from mixtrain.comm.state_transfer import unpack


def split_runs(sizes: Sequence[int], weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous runs [lo, hi) of parameters (by element count `sizes`) per rank, each rank's elements as
    close to its fraction of `weights` as whole parameters allow. A rank with weight 0 owns nothing."""
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"optimizer shard weights {list(weights)} must be non-negative with a positive sum")
    total = sum(sizes)
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + total * w / sum(weights))
    runs, lo, seen = [], 0, 0
    for rank in range(len(weights)):
        hi = lo
        if rank == len(weights) - 1:
            hi = len(sizes)
        else:  # take parameters while the running total is nearer this rank's bound with them than without
            while hi < len(sizes) and abs(seen + sizes[hi] - bounds[rank + 1]) <= abs(seen - bounds[rank + 1]):
                seen += sizes[hi]
                hi += 1
        runs.append((lo, hi))
        lo = hi
    return runs


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults its constructor takes (AdamW keeps `decoupled_weight_decay` in its defaults but
    takes no such argument); the groups carry every hyperparameter anyway."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


class ShardedOptimizer:
    """This rank's slice of the optimizer: a private instance of the user's optimizer class over its run.

    `offload`: the slice's optimizer state, and an fp32 master copy of its weights, live in host memory and the
    step runs there (the gradients go to the host, the updated weights come back): a GPU then holds weights,
    gradients and activations only. The math is the same: the master copy starts equal to the weights and every
    update of them goes through it."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, runs: list[tuple[int, int]], rank: int, offload: bool = False
    ) -> None:
        self.user = optimizer
        self.params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.runs = runs
        self.rank = rank
        lo, hi = runs[rank]
        mine = {id(p) for p in self.params[lo:hi]}
        self.master: dict[int, torch.nn.Parameter] = {}
        if offload:
            for p in self.params[lo:hi]:
                self.master[id(p)] = torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True))
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [self.master.get(id(p), p) for p in g["params"] if id(p) in mine],
            }
            for g in optimizer.param_groups
        ]
        self.local = type(optimizer)(groups, **_constructor_defaults(optimizer))  # same class, only this run
        self.owned = range(lo, hi)

    def step(self, broadcast: bool = True) -> None:
        """Step this rank's run, then (`broadcast`) every owner broadcasts its run (one collective per rank);
        without, each run stays with its owner (weights sliced too: shard/sliced.py)."""
        for mine, theirs in zip(self.local.param_groups, self.user.param_groups):
            for key, value in theirs.items():  # what the LR scheduler (or the user) changed since
                if key != "params":
                    mine[key] = value
        if len(self.owned):
            self._step_local()
        if broadcast:
            self.broadcast()

    def broadcast(self) -> None:
        """Every owner's run to every rank (one collective per owner)."""
        for owner, (lo, hi) in enumerate(self.runs):
            if hi > lo:  # in pieces of at most 16 MB, a large weight in place: no copy of the run
                replicas.broadcast_tensors(self.params[lo:hi], src=owner)

    def _step_local(self) -> None:
        """Step the slice (on the host, from its master copy, when offloaded)."""
        if not self.master:
            self.local.step()
            return
        owned = self.params[self.owned.start : self.owned.stop]
        for p in owned:
            self.master[id(p)].grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)
        self.local.step()
        with torch.no_grad():
            for p in owned:
                p.data.copy_(self.master[id(p)].detach())  # (to the device, in the weights' dtype)
                self.master[id(p)].grad = None

    def state_part(self) -> dict[int, dict[str, Any]]:
        """This rank's optimizer state keyed by the user's optimizer parameter numbers."""
        state = self.local.state_dict()["state"]  # numbered 0.. over this run's parameters, in order
        return {self.owned.start + i: s for i, s in state.items()}

    def load_full(self, full: dict[str, Any]) -> None:
        """From a full optimizer state_dict (a checkpoint's, packed or not): keep this rank's entries, copied (the
        source may be read-only memory shared with other processes)."""
        self.user.load_state_dict({"state": {}, "param_groups": full["param_groups"]})
        sd = self.local.state_dict()
        sd["state"] = {
            i - self.owned.start: unpack(full["state"][i], copy=True) for i in self.owned if i in full["state"]
        }
        for mine, theirs in zip(sd["param_groups"], full["param_groups"]):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self.local.load_state_dict(sd)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(
            v.numel() * v.element_size() for s in self.local.state.values() for v in s.values() if torch.is_tensor(v)
        )
