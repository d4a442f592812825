"""A replica's training state: packed for checkpoints, replacements and survivors that fell behind, loaded back
(weights and scheduler at once; optimizer, loss scale and the strategy's own state once the group forms), and
carried into the strategy of a new formation (TrainWorker.join)."""

from __future__ import annotations

import torch

from mixtrain import frozen_base
from mixtrain.comm.state_transfer import pack, unpack
from mixtrain.comm.strategy import SyncStrategy
from mixtrain.devices import DeviceKind
from mixtrain.observe import worker_log
from mixtrain.task import Task


def packed(task: Task, strategy: SyncStrategy) -> dict:
    """Everything a step changes, packed (TrainWorker.training_state)."""
    state = {
        "model": strategy.model_state(task),
        "optimizer": strategy.optimizer_state(task),
        "scheduler": task.scheduler.state_dict() if task.scheduler is not None else None,
        "loss_scale": strategy.loss_scale.state_dict(),
        "strategy": strategy.state_dict(),
    }
    return pack(state)


def load(
    task: Task,
    strategy: SyncStrategy | None,
    kind: DeviceKind,
    state: dict,
    rng: dict | None,
    rank_state: dict | None,
) -> dict:
    """Weights, scheduler and random streams from `state` (and `rng`) now (TrainWorker.load_training_state); what
    the strategy takes when the group forms comes back, for `before_setup` and `after_setup`. `strategy`: the one
    of the last formation, if any."""
    if strategy is not None and strategy.slices_weights:
        strategy.close()  # every weight whole again, to be filled from `state` (sliced at the next join)
    frozen_base.load_model_state(task.model, unpack(state["model"]))  # copies in; a checkpoint may lack the base
    if task.scheduler is not None and state.get("scheduler") is not None:
        task.scheduler.load_state_dict(unpack(state["scheduler"], copy=True))
    loaded = {
        "optimizer": state["optimizer"],
        "loss_scale": state["loss_scale"],
        "strategy": state.get("strategy") or {},
        "rank": rank_state or {},
    }
    if rank_state and rank_state.get("optimizer") is not None:  # this replica's own inner optimizer
        loaded["optimizer"] = rank_state["optimizer"]
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if kind.kind in rng:  # the device's own stream, when the checkpoint has one for this kind
            kind.set_rng_state(rng[kind.kind])
    return loaded


# A re-formed group keeps the strategy's state (the same on every rank), unless state was just loaded (a resume, a
# replacement, a survivor that fell behind, a sharded optimizer re-split): `loaded` (from `load`), else `previous`
# (the last formation's strategy, if any).


def before_setup(task: Task, strategy: SyncStrategy, loaded: dict | None, previous: SyncStrategy | None) -> None:
    """The strategy's own state and the optimizer's, before the strategy is set up on the new group."""
    if loaded is not None:
        strategy.load_state_dict(unpack(loaded["strategy"], copy=True))
        strategy.load_optimizer_state(task, loaded["optimizer"])
    elif previous is not None:
        strategy.load_state_dict(previous.state_dict())


def after_setup(task: Task, strategy: SyncStrategy, loaded: dict | None, previous: SyncStrategy | None) -> None:
    """This rank's own state and the job-wide loss scale, once the strategy is set up on the new group."""
    if loaded is not None and loaded.get("rank"):
        strategy.load_rank_state(task, unpack(loaded["rank"], copy=True))
    if getattr(strategy, "gate", None) is not None:
        worker_log.log.info("steps: the all-finite verdict is read a step late (StepGate, fused optimizer)")
    if loaded is not None:  # and the job-wide loss scale
        strategy.loss_scale.load_state_dict(loaded["loss_scale"])
    elif previous is not None:
        strategy.loss_scale = previous.loss_scale
