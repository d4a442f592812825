"""Callbacks: your code on the driver at the run's events (Lightning's and Hugging Face's habit).

    class PrintLoss(mixtrain.Callback):
        def on_round_end(self, event):
            print(event.global_step, event.loss, event.lr)

    Trainer(..., callbacks=[PrintLoss(), mixtrain.EarlyStopping("loss", patience=3)])

Each hook gets one typed event (below) and runs on the driver between rounds, never inside a step. Every event
is also a line in the run folder's metrics.jsonl: a callback sees what the file records. A callback that raises
is reported once (its name, the hook and the error, in the terminal and in metrics.jsonl as `callback_error`)
and training goes on; one that raises `StopTraining` ends the run at the next round boundary with a checkpoint
and the final weights, as if the last epoch had ended there. A callback with state that must survive a resume
(a patience count) returns it from `state_dict()` (JSON values) and takes it back in `load_state_dict()`: it is
saved in every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "Callback",
    "CheckpointSaved",
    "EarlyStopping",
    "Evaluated",
    "RoundEnded",
    "RunEnded",
    "RunStarted",
    "StopTraining",
    "WorkersChanged",
]


EVAL_KEYS = ("kind", "time", "epoch", "step", "global_step", "samples")
"""An evaluation record's fields that are not metrics."""


class StopTraining(Exception):  # Lightning's and Keras's name for the same thing
    """Raise it in a callback to end the run at the next round boundary, with a checkpoint and final weights;
    `fit()` returns normally and `Result.stopped_early` holds the message."""


RUN_ID_MAX = 64
"""A run id is a few letters and digits (mixtrain makes 12 hex digits): one read from a folder that is longer, or
holds anything else, is not used to pick a tracker's run (MLflow's search filter, W&B's run id)."""


def is_run_id(value: object) -> bool:
    """Whether `value` looks like a run id: 1 to RUN_ID_MAX ASCII letters and digits."""
    return isinstance(value, str) and 0 < len(value) <= RUN_ID_MAX and value.isascii() and value.isalnum()


@dataclass(frozen=True)
class RunStarted:
    run_dir: Path
    run_id: str
    config: dict[str, Any]
    """What config.json holds: the resolved scaling, run and strategy settings, global batch, epochs, shares."""
    epochs: int
    max_steps: int | None
    steps_per_epoch: int
    global_step: int
    """Where training starts: 0, or the step a resumed run continues at."""
    resumed_from: Path | None


@dataclass(frozen=True)
class RoundEnded:
    """A round of steps trained on every worker (the workers take several steps per driver call)."""

    epoch: int
    step: int
    """Steps done in this epoch at the round's end."""
    global_step: int
    """Steps done since the run's start (epochs x steps per epoch + step): what `max_steps` counts."""
    samples_seen: int
    loss: float
    """The round's mean training loss."""
    samples_per_s: float
    shares: list[int]
    """Samples of each global batch per worker, by rank."""
    grad_norm: float | None
    """The mean gradient norm before clipping (None when the task does not clip)."""
    lr: list[float]
    """The learning rate of each of the optimizer's param groups at the round's end."""
    record: dict[str, Any] = field(repr=False)
    """The round's whole line in metrics.jsonl (per-worker compute, wait, communication, memory)."""


@dataclass(frozen=True)
class Evaluated:
    """The held-out metrics after `global_step` steps (at an epoch's end, or every RunConfig.eval_every steps)."""

    epoch: int
    step: int
    global_step: int
    samples_seen: int
    metrics: dict[str, float]
    """loss, and the task's own metrics (accuracy, ...)."""


@dataclass(frozen=True)
class CheckpointSaved:
    path: Path
    epoch: int
    step: int
    global_step: int


@dataclass(frozen=True)
class WorkersChanged:
    """The workers changed: one was lost, left out as too slow, taken back, or replaced."""

    kind: Literal["lost", "left_out", "readmitted", "rejoined"]
    workers: list[dict[str, Any]]
    """Who: each as Result.workers describes it (rank, host, device, ...)."""
    reason: str
    record: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class RunEnded:
    """The run ended: `result` is the Result fit() returns, None when it ended with `error`."""

    run_dir: Path
    result: Any = None
    error: BaseException | None = None
    stopped_early: str | None = None


class Callback:
    """Override the hooks you need; the others do nothing. Hooks run on the driver, in the order the callbacks
    were given, between rounds."""

    def on_run_start(self, event: RunStarted) -> None:
        """The workers are up and planned; the first round is next."""

    def on_round_end(self, event: RoundEnded) -> None:
        """A round of steps is done (loss, samples/s, shares, grad norm, learning rates)."""

    def on_eval_end(self, event: Evaluated) -> None:
        """The held-out metrics are in."""

    def on_checkpoint(self, event: CheckpointSaved) -> None:
        """A checkpoint was written (and is complete on disk)."""

    def on_workers_changed(self, event: WorkersChanged) -> None:
        """A worker was lost, left out, taken back, or replaced."""

    def on_run_end(self, event: RunEnded) -> None:
        """Last call: after the final weights were written, or with the error that ended the run."""

    def state_dict(self) -> dict[str, Any]:
        """What must survive a resume (JSON values): saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what state_dict() returned, when a run resumes."""


class EarlyStopping(Callback):
    """Stop when a held-out metric has not improved by more than `min_delta` for `patience` evaluations in a row
    (Lightning's and Keras's rule). Its count is kept in every checkpoint, so a resumed run goes on counting.

        Trainer(..., eval_data=..., callbacks=[EarlyStopping("loss", patience=3)])
    """

    def __init__(
        self, metric: str = "loss", mode: Literal["min", "max"] = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        from mixtrain import _checks as check

        check.text("EarlyStopping.metric", metric)
        check.choice("EarlyStopping.mode", mode, ("min", "max"))
        check.integer("EarlyStopping.patience", patience, 1)
        check.number("EarlyStopping.min_delta", min_delta, 0)
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, float(min_delta)
        self.best: float | None = None
        self.bad_evals = 0
        """Evaluations in a row without an improvement."""

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_eval_end(self, event: Evaluated) -> None:
        value = metric_value(event.metrics, self.metric, "EarlyStopping.metric")
        if self.improved(value):
            self.best, self.bad_evals = value, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            raise StopTraining(
                f"held-out {self.metric} has not improved on {self.best:.6g} for {self.bad_evals} evaluations "
                f"(patience {self.patience}, min_delta {self.min_delta:g})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        best, bad = state.get("best"), state.get("bad_evals", 0)
        if (best is None or isinstance(best, (int, float))) and isinstance(bad, int) and bad >= 0:
            self.best, self.bad_evals = best, bad


def metric_value(metrics: dict[str, float], name: str, field: str) -> float:
    """metrics[name], or MetricMissing naming the field, the value and the metrics there are."""
    metrics = {k: v for k, v in metrics.items() if k not in EVAL_KEYS}
    if name not in metrics:
        from mixtrain.errors import MetricMissing

        raise MetricMissing(
            f"{field}={name!r}: the evaluation has no such metric; it has {sorted(metrics)} (the task's "
            "metrics plus loss): name one of those"
        )
    return float(metrics[name])
