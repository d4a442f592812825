"""What a loop calls on its worker (Ray Train's names)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.train import _session
from mixtrain.train._session import TrainContext
from mixtrain.train.checkpoint import Checkpoint


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Hand this epoch's (or step's) metrics to the driver, with a checkpoint to restart from if given: call it on
    every worker at the same point of the loop (as Ray Train asks). The driver keeps rank 0's metrics and the
    checkpoint (written whole, the newest few kept); Ctrl-C stops every worker here."""
    _session.current("report").report(metrics, checkpoint)


def get_context() -> TrainContext:
    """Who this worker is: world rank and size, local rank, node rank, its device and its current share."""
    return _session.current("get_context").context


def get_checkpoint() -> Checkpoint | None:
    """The last checkpoint the run reported (a restarted loop, a resumed run), as a folder on this machine; None
    in a loop that starts from scratch. A loop that calls it resumes: only then may mixtrain restart it without a
    slow worker (restarting a loop that does not resume would train its first epochs again)."""
    session = _session.current("get_checkpoint")
    if not session.resumes and session.context.world_rank == 0:
        session.event_to("resumes", {})  # the driver says "from the start" after a loss where nobody asks
    session.resumes = True
    return session.checkpoint


def get_device() -> torch.device:
    """This worker's torch device (CUDA, MPS or CPU)."""
    return _session.current("get_device").context.device


def sum_over_workers(values: dict[str, Any]) -> dict[str, float]:
    """`values` (names to numbers) summed over every worker, the same totals returned on every rank: one small
    all-reduce. For a held-out figure over the whole set, each worker counts on its own part and the totals make
    the figure: `t = sum_over_workers({"correct": correct, "count": count}); t["correct"] / t["count"]` (a
    prepared held-out loader hands each worker a share by its speed, so rank 0's own count is only its part).
    Call it on every worker at the same point with the same names, as any collective. With one worker, or
    outside a run with no process group (the same script run alone), the values come back as they are; under
    torchrun it sums over torch.distributed's group."""
    names, numbers = _numbers(values)
    size = _world_size()
    if size == 1:
        return dict(zip(names, numbers))
    from mixtrain.comm.replicas import comm_device

    digest = _names_digest(names)  # the same names everywhere, or the sum of the digests says not
    totals = torch.tensor([*numbers, digest], dtype=torch.float64, device=comm_device())
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    summed = totals.cpu().tolist()
    if summed[-1] != digest * size:
        raise InputValueError(
            f"sum_over_workers({sorted(names)}): the workers gave different names; give every worker the same "
            "names, each with its own part (0 where it has none)"
        )
    return dict(zip(names, summed[:-1]))


def _numbers(values: Any) -> tuple[list[str], list[float]]:
    if not isinstance(values, dict) or not values:
        raise InputTypeError(
            f"sum_over_workers(values={values!r}): give a dict of names to numbers, e.g. "
            "{'correct': correct, 'count': len(y)}"
        )
    names, numbers = [], []
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputTypeError(
                f"sum_over_workers: {name!r} is {value!r}; give a number (or a tensor of one element), e.g. "
                "(pred == y).sum().item()"
            )
        names.append(str(name))
        numbers.append(float(value))
    return names, numbers


def _world_size() -> int:
    """The loop's workers; outside a mixtrain run, torch.distributed's group (torchrun), else 1."""
    if _session._current is not None:
        return _session._current.context.world_size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _names_digest(names: list[str]) -> float:
    """A number for the names in order, exact in a float64 sum over up to 2**21 workers."""
    return float(int.from_bytes(hashlib.blake2b("\0".join(names).encode(), digest_size=4).digest(), "big"))
