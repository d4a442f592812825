"""What a loop calls on its worker (Ray Train's names)."""

from __future__ import annotations

from typing import Any

import torch

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
    session.resumes = True
    return session.checkpoint


def get_device() -> torch.device:
    """This worker's torch device (CUDA, MPS or CPU)."""
    return _session.current("get_device").context.device
