"""Which of mixtrain's settings a training loop (mixtrain.train) honours. Every ScalingConfig field is either used by
the loop's run (HONOURED) or refused here by name when set to anything the loop would not do anyway (REFUSED): a
setting taken and silently dropped would change a person's training without a word (issue 45). No torch or Ray."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from mixtrain.config import DeviceGroup, ScalingConfig
from mixtrain.errors import InputValueError

HONOURED = frozenset(
    {
        # the worker group places and starts the loop's workers as a Task's (group/worker_group.py)
        "num_workers",
        "cpus_per_worker",
        "use_gpu",
        "resources_per_worker",
        "accelerator_type",
        "groups",
        "placement_strategy",
        "address",
        "network_interface",
        "threads_per_worker",
        "shard_optimizer",  # deprecated: becomes shard="optimizer", refused under that name
        "keep_workers",
        # the loop's group and prepared loaders
        "backend",
        "shares",
        "leave_out_slow",
        "emulate_slowdown",
    }
)
"""ScalingConfig fields a loop run uses as mixtrain.Trainer does."""

_AUTOCAST = "the loop keeps its own precision: use torch.autocast(...) in the loop where you want a lower one"
_NUMERICS = "the check compares a Task's gradient on each device with the CPU's; a training loop has no Task to check"
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "precision": (lambda v: v == "fp32", _AUTOCAST),
    "numerics_check": (lambda v: v != "strict", _NUMERICS),
    "numerics_tolerance": (lambda v: v is None, _NUMERICS),
    "max_micro_batch": (
        lambda v: v is None,
        "the loop sizes its own batches: lower the loader's batch_size, or accumulate with model.no_sync()",
    ),
    "shard": (
        lambda v: v == "none",
        "a loop slices a model where it prepares it: prepare_model(model, shard='gradients' or 'full')",
    ),
    "shard_slices": (
        lambda v: v is None,
        "a loop sizes the slices where it prepares a model: prepare_model(model, shard=..., slices=[3, 1, 2])",
    ),
    "offload": (lambda v: v == "none", "the loop steps its own optimizer where its weights are (Trainer offloads)"),
}
"""ScalingConfig field -> (whether a value is one the loop honours, why another is not)."""


def check_loop_scaling(scaling: ScalingConfig) -> None:
    """Refuse, naming the field, the value and what to do, each setting a training loop would not honour."""
    for name, (fine, why) in REFUSED.items():
        value = getattr(scaling, name)
        if not fine(value):
            default = next(f.default for f in fields(ScalingConfig) if f.name == name)
            raise InputValueError(
                f"ScalingConfig.{name}={value!r} with a training loop (mixtrain.train): {why}; leave it at {default!r}"
            )
    for group in scaling.groups if isinstance(scaling.groups, (list, tuple)) else ():
        if isinstance(group, DeviceGroup) and group.precision not in (None, "fp32"):
            raise InputValueError(f"DeviceGroup.precision={group.precision!r} with a training loop: {_AUTOCAST}")
        if isinstance(group, DeviceGroup) and group.memory is not None:
            raise InputValueError(
                f"DeviceGroup.memory={group.memory!r} with a training loop: a loop sizes its slices where it prepares "
                "the model: prepare_model(model, shard=..., slices=[...]); leave memory at None"
            )
    late = {rank: start for rank, (_, start) in scaling.slowdown().items() if start > 0}
    if late:
        raise InputValueError(
            f"ScalingConfig.emulate_slowdown (or MIXTRAIN_EMULATE_SLOWDOWN) from round {late} with a training loop: "
            "a loop has no rounds, so the slowdown would apply from its start; give {rank: factor}"
        )


def check_ray_options(options: dict[str, Any]) -> None:
    """Ray TorchTrainer's other arguments (torch_config, datasets, dataset_config, metadata): accepted as None, so a
    Ray Train script's call runs unchanged, and refused when set, as nothing here would act on them."""
    for name, value in options.items():
        if value is not None:
            raise InputValueError(
                f"TorchTrainer({name}={value!r}): mixtrain does not use {name} (the loop reads its data through "
                "prepare_data_loader, and the collective backend is ScalingConfig.backend); leave it out"
            )


_DDP_KWARGS = {
    "find_unused_parameters": None,
    "gradient_as_bucket_view": None,
    "static_graph": None,
    "bucket_cap_mb": None,
    "device_ids": None,
    "output_device": None,
    "broadcast_buffers": True,
}
"""DDP's options a Ray Train loop may pass through prepare_model(parallel_strategy_kwargs=...), and the one value
mixtrain's exchange honours (None: any; they change how DDP buckets or finds gradients, not the sum it gives)."""


def check_prepare_model_options(move_to_device: Any, parallel_strategy: Any, strategy_kwargs: Any) -> None:
    """Ray Train's prepare_model options: those whose value mixtrain does anyway are accepted (so a Ray Train loop
    runs unchanged); any other is refused naming it, as taking and dropping it would change the training."""
    if move_to_device is not True:
        raise InputValueError(
            f"prepare_model(move_to_device={move_to_device!r}): mixtrain puts the model on the worker's own device "
            "(get_device()); leave move_to_device out"
        )
    if parallel_strategy == "fsdp":
        raise InputValueError(
            "prepare_model(parallel_strategy='fsdp'): slice the model with prepare_model(model, shard='full') "
            "(weights, gradients and optimizer state by each worker's memory); leave parallel_strategy out"
        )
    if parallel_strategy != "ddp":
        raise InputValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}): every prepared model's gradients are summed "
            "over the workers (DDP's way); leave parallel_strategy out"
        )
    for name, value in (strategy_kwargs or {}).items():
        if name not in _DDP_KWARGS:
            raise InputValueError(
                f"prepare_model(parallel_strategy_kwargs={{{name!r}: ...}}): mixtrain's exchange has no such "
                f"option; it takes {sorted(_DDP_KWARGS)}"
            )
        if _DDP_KWARGS[name] is not None and value != _DDP_KWARGS[name]:
            raise InputValueError(
                f"prepare_model(parallel_strategy_kwargs={{{name!r}: {value!r}}}): mixtrain's prepared model keeps "
                f"{name}={_DDP_KWARGS[name]!r} (rank 0's buffers, as DDP's default); leave it out"
            )


def check_prepare_loader_options(add_dist_sampler: Any) -> None:
    """Ray Train's prepare_data_loader options (auto_transfer, a CUDA copy stream, changes no batch: any value)."""
    if add_dist_sampler is not True:
        raise InputValueError(
            f"prepare_data_loader(add_dist_sampler={add_dist_sampler!r}): mixtrain always splits each step's "
            "global batch over the workers (each worker reading the whole set is not a run it can keep exact); "
            "leave add_dist_sampler out"
        )
