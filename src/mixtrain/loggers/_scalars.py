"""What every logger writes, computed once: the same names in MLflow, W&B and TensorBoard."""

from __future__ import annotations

import re
from typing import Any

from mixtrain.callbacks import Evaluated, RoundEnded
from mixtrain.observe.runlog import plain
from mixtrain.records.rounds import device_samples_per_s, worker_name


def round_scalars(event: RoundEnded) -> dict[str, float]:
    """A round's numbers by name: loss, speed, gradient norm, each param group's learning rate, and each
    worker's speed and share (named by its device, in TensorBoard's tag alphabet)."""
    out = {"train/loss": float(event.loss), "train/samples_per_s": float(event.samples_per_s)}
    if event.grad_norm is not None:  # the task clips: the mean norm before clipping
        out["train/grad_norm"] = float(event.grad_norm)
    for i, lr in enumerate(event.lr):
        out[f"train/lr/group{i}"] = float(lr)
    r = event.record
    for rank, (w, share) in enumerate(zip(r.get("workers", []), event.shares)):
        name = tag_name(worker_name(w, rank))
        out[f"samples_per_s/{name}"] = float(device_samples_per_s(r, w))
        out[f"share/{name}"] = float(share)
    return out


def eval_scalars(event: Evaluated) -> dict[str, float]:
    """held_out/<metric> for loss and each of the task's metrics."""
    return {f"held_out/{k}": float(v) for k, v in event.metrics.items() if isinstance(v, (int, float))}


def tag_name(text: str) -> str:
    """`cpu on host (pid 12)` -> `cpu_on_host_pid_12`: letters, digits, `_`, `.` and `-` only (TensorBoard's tag
    alphabet; MLflow's metric names take them too)."""
    return re.sub(r"[^\w.\-]+", "_", text).strip("_")


def flat_params(config: dict[str, Any], max_len: int = 500) -> dict[str, str]:
    """RunStarted.config as flat `section.field` -> text (scaling.num_workers, run.seed, strategy.name,
    global_batch, epochs, ...): what MLflow's params hold. A long value is cut to `max_len` characters."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        text = str(value)
        out[prefix] = text if len(text) <= max_len else text[: max_len - 3] + "..."

    walk("", plain(config, str))
    return out
