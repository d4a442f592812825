"""The user's callbacks, called from the run's records: every line the driver writes to metrics.jsonl passes here
on its way, and the kinds a callback hears of become typed events (mixtrain/callbacks.py). One place decides what
a failing callback costs (a line, once per callback and hook; training goes on) and what StopTraining does (the
controller finishes at the next round boundary). No Ray, no torch."""

from __future__ import annotations

import json
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from mixtrain.callbacks import (
    EVAL_KEYS,
    Callback,
    CheckpointSaved,
    Evaluated,
    RoundEnded,
    RunEnded,
    RunStarted,
    StopTraining,
    WorkersChanged,
)
from mixtrain.errors import InputTypeError, MetricMissing

Change = Literal["lost", "left_out", "readmitted", "rejoined"]


class Sink(Protocol):
    def write(self, kind: str, record: dict[str, Any]) -> None: ...


def check_callbacks(callbacks: Any) -> list[Callback]:
    """The `callbacks=` argument as a list, each a mixtrain.Callback (a clear error otherwise)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise InputTypeError(f"callbacks={callbacks!r}: give a list of mixtrain.Callback objects")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            what = "a class: give an instance, e.g. EarlyStopping(...)" if isinstance(cb, type) else repr(cb)
            raise InputTypeError(
                f"callbacks[{i}]={what}: each callback must be an instance of a mixtrain.Callback subclass "
                "(override on_round_end, on_eval_end, ...)"
            )
    return list(callbacks)


class Hooks:
    """Calls each callback's hooks; remembers a StopTraining; reports a callback's first error per hook."""

    def __init__(
        self,
        callbacks: Sequence[Callback] = (),
        *,
        steps_per_epoch: int = 1,
        num_samples: int = 0,
        global_batch: int = 1,
        say: Any = None,
    ) -> None:
        self.callbacks = list(callbacks)
        self.steps_per_epoch = steps_per_epoch
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.say = say or (lambda message: None)
        """Prints a line for the person at the terminal (the progress view's log)."""
        self.log: Sink | None = None
        self.stop_reason: str | None = None
        """A callback raised StopTraining: the run ends at the next round boundary."""
        self.errors: dict[tuple[str, str], int] = {}
        """(callback, hook) -> how many times it raised (reported once)."""
        self.missing_metric: MetricMissing | None = None
        """A callback's metric that an evaluation lacked (EarlyStopping's): the run stops there (controller)."""

    def watch(self, log: Sink) -> Watched:
        """`log`, with each record it writes also passed to the callbacks."""
        self.log = log
        return Watched(log, self)

    # ---- events ---------------------------------------------------------------------------------
    def record(self, kind: str, r: dict[str, Any]) -> None:
        """A line just written to metrics.jsonl: the event it is, if any, to every callback."""
        if not self.callbacks:
            return
        if kind == "round":
            self.fire("on_round_end", self.round_event(r))
        elif kind == "eval":
            self.fire("on_eval_end", self.eval_event(r))
        elif kind == "checkpoint":
            event = CheckpointSaved(Path(r["path"]), r["epoch"], r["step"], r["global_step"])
            self.fire("on_checkpoint", event)
        elif kind in ("left_out", "readmitted", "rejoined"):
            change = WorkersChanged(cast(Change, kind), [_worker(r.get("worker"))], str(r.get("reason", "")), dict(r))
            self.fire("on_workers_changed", change)
        elif kind == "failure":
            lost = r.get("lost", [])
            reason = "; ".join(str(x.get("reason", "")) for x in lost)
            workers = [_worker(x.get("worker")) for x in lost]
            self.fire("on_workers_changed", WorkersChanged("lost", workers, reason, dict(r)))

    def global_step(self, epoch: int, step: int) -> int:
        return epoch * self.steps_per_epoch + step

    def samples_seen(self, epoch: int, step: int) -> int:
        return epoch * self.num_samples + min(self.num_samples, step * self.global_batch)

    def round_event(self, r: dict[str, Any]) -> RoundEnded:
        step = r["first_step"] + r["num_steps"]
        return RoundEnded(
            epoch=r["epoch"],
            step=step,
            global_step=self.global_step(r["epoch"], step),
            samples_seen=self.samples_seen(r["epoch"], step),
            loss=r["loss"],
            samples_per_s=r["samples_per_s"],
            shares=list(r["shares"]),
            grad_norm=r.get("grad_norm"),
            lr=list(r.get("lr") or []),
            record=dict(r),
        )

    def eval_event(self, r: dict[str, Any]) -> Evaluated:
        epoch, step = r["epoch"], r.get("step", self.steps_per_epoch)  # an epoch's end: all its steps
        metrics = {k: v for k, v in r.items() if k not in EVAL_KEYS and isinstance(v, (int, float))}
        return Evaluated(epoch, step, self.global_step(epoch, step), self.samples_seen(epoch, step), metrics)

    def run_started(self, event: RunStarted) -> None:
        self.fire("on_run_start", event)

    def run_ended(self, event: RunEnded) -> None:
        self.fire("on_run_end", event)

    # ---- calling --------------------------------------------------------------------------------
    def fire(self, hook: str, event: Any) -> None:
        for cb in self.callbacks:
            try:
                getattr(cb, hook)(event)
            except MetricMissing as exc:  # the run's own setting names no metric there: the controller stops
                self.missing_metric = self.missing_metric or exc
            except StopTraining as stop:
                if self.stop_reason is None:
                    self.stop_reason = f"{type(cb).__name__}: {stop}" if str(stop) else type(cb).__name__
                    self.say(f"stopping early, at the next round boundary: {self.stop_reason}")
                    self._write("stop_requested", {"callback": type(cb).__name__, "reason": self.stop_reason})
            except Exception as exc:  # a callback's bug must not end a healthy run
                self._failed(cb, hook, exc)

    def _failed(self, cb: Callback, hook: str, exc: Exception) -> None:
        key = (type(cb).__name__, hook)
        self.errors[key] = self.errors.get(key, 0) + 1
        if self.errors[key] > 1:
            return
        line = f"callback {key[0]}.{hook} raised {type(exc).__name__}: {exc}; training goes on (reported once)"
        self.say(line)
        self._write(
            "callback_error",
            {"callback": key[0], "hook": hook, "error": f"{type(exc).__name__}: {exc}", "trace": _trace(exc)},
        )

    def _write(self, kind: str, record: dict[str, Any]) -> None:
        if self.log is not None:
            self.log.write(kind, record)

    # ---- state across a resume --------------------------------------------------------------------
    def state(self) -> str:
        """Every callback's state_dict(), as JSON (kept in each checkpoint): by position and class name."""
        states = []
        for cb in self.callbacks:
            try:
                state = cb.state_dict()
                json.dumps(state)
            except Exception as exc:
                self._failed(cb, "state_dict", exc)
                state = {}
            states.append({"callback": type(cb).__name__, "state": state})
        return json.dumps(states)

    def load_state(self, saved: Any) -> None:
        """Give each callback its state back from a checkpoint (matched by position and class name). What the
        checkpoint says is checked (it is a file in a folder others may write): a malformed entry is a note."""
        if not isinstance(saved, str) or not self.callbacks:
            return
        try:
            states = json.loads(saved)
        except ValueError:
            self.say("the checkpoint's callback state is not JSON: callbacks start afresh")
            return
        if not isinstance(states, list):
            return
        for i, cb in enumerate(self.callbacks):
            entry = states[i] if i < len(states) else None
            ok = isinstance(entry, dict) and entry.get("callback") == type(cb).__name__
            if not ok or not isinstance(entry.get("state"), dict):  # type: ignore[union-attr]
                self.say(f"no saved state for callback {i} ({type(cb).__name__}) in the checkpoint: it starts afresh")
                continue
            try:
                cb.load_state_dict(entry["state"])  # type: ignore[index]
            except Exception as exc:
                self._failed(cb, "load_state_dict", exc)


class Watched:
    """A log whose writes the callbacks also hear (the controller, its changes and its checkpoints write here)."""

    def __init__(self, log: Sink, hooks: Hooks) -> None:
        self.inner = log
        self.hooks = hooks

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self.inner.write(kind, record)
        self.hooks.record(kind, record)


def _worker(info: Any) -> dict[str, Any]:
    """A worker as Result.workers describes it (the records carry WorkerInfo objects)."""
    if info is None:
        return {}
    return info.as_dict() if hasattr(info, "as_dict") else dict(info)


def _trace(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]
