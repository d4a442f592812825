"""The run folder: resolved config, metrics.jsonl, TensorBoard event files (optional), final weights."""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from mixtrain.config import RunConfig
from mixtrain.core.rounds import device_samples_per_s, worker_name

TENSORBOARD_DIR = "tensorboard"


def make_run_dir(run: RunConfig) -> Path:
    if run.run_dir is not None:
        path = Path(run.run_dir)
    else:
        name = run.name or time.strftime("run-%Y%m%d-%H%M%S")
        path = Path(run.storage_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: _plain(v) for k, v in asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return repr(obj)


def samples_seen(record: dict[str, Any], num_samples: int, global_batch: int) -> int:
    """Training samples used up to the end of a round or an epoch's evaluation. From (epoch, step), not a
    running sum, so a resumed run that repeats rounds after its checkpoint counts them once."""
    if record.get("kind") == "eval":
        return (record["epoch"] + 1) * num_samples
    end = record["first_step"] + record["num_steps"]
    return record["epoch"] * num_samples + min(num_samples, end * global_batch)


def _summary_writer_class() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter


def check_tensorboard(wanted: bool | None) -> None:
    """Fail before anything starts when TensorBoard files are required but cannot be written."""
    if wanted and _summary_writer_class() is None:
        raise ValueError(
            "RunConfig.tensorboard=True (--tensorboard) but neither tensorboardX nor tensorboard is installed: "
            "pip install 'mixtrain[tensorboard]', or leave tensorboard at None (write when installed)"
        )


def tensorboard_writer(run_dir: Path, wanted: bool | None) -> Any:
    """A SummaryWriter in RUN_DIR/tensorboard: tensorboardX's, or torch's (which needs `tensorboard`).
    `wanted`: None writes when either is installed, True requires one, False writes none."""
    if wanted is False:
        return None
    check_tensorboard(wanted)
    writer = _summary_writer_class()
    return None if writer is None else writer(str(run_dir / TENSORBOARD_DIR), flush_secs=10)


class RunLog:
    """Appends one JSON line per event to metrics.jsonl, and the main scalars to TensorBoard."""

    def __init__(self, run_dir: Path, config: dict[str, Any], tensorboard: bool | None = None) -> None:
        self.run_dir = run_dir
        (run_dir / "config.json").write_text(json.dumps(_plain(config), indent=2) + "\n")
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._size = (int(config.get("num_samples", 0)), int(config.get("global_batch", 1)))
        self._tb = tensorboard_writer(run_dir, tensorboard)

    def write(self, kind: str, record: dict[str, Any]) -> None:
        line = {"kind": kind, "time": time.time(), **_plain(record)}
        self._metrics.write(json.dumps(line) + "\n")
        if self._tb is not None and kind in ("round", "eval"):
            self._scalars(line)

    def _scalars(self, r: dict[str, Any]) -> None:
        step = samples_seen(r, *self._size)
        add = self._tb.add_scalar
        if r["kind"] == "eval":
            for key, value in r.items():  # loss, accuracy and the task's own metrics
                if key not in ("kind", "time", "epoch", "samples") and isinstance(value, (int, float)):
                    add(f"held_out/{key}", value, step)
            return
        add("train/loss", r["loss"], step)
        add("train/samples_per_s", r["samples_per_s"], step)
        if r.get("grad_norm") is not None:  # the task clips: the mean norm before clipping
            add("train/grad_norm", r["grad_norm"], step)
        for rank, (w, share) in enumerate(zip(r["workers"], r["shares"])):
            name = re.sub(r"[^\w.\-]+", "_", worker_name(w, rank)).strip("_")  # TensorBoard's tag alphabet
            add(f"samples_per_s/{name}", device_samples_per_s(r, w), step)
            add(f"share/{name}", share, step)

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
