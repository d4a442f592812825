"""The held-out evaluation on the driver: when one is due, running it across the workers, recording it. (What a
worker computes of it is worker/evaluation.py's.) No Ray: the controller hands over its group port."""

from __future__ import annotations

from typing import Any

from mixtrain.callbacks import EVAL_KEYS
from mixtrain.driver.changes import Changes
from mixtrain.driver.schedule import Steps, eval_batches, eval_split
from mixtrain.driver.states import Position, Train
from mixtrain.group.port import GroupPort
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog
from mixtrain.records.run_state import RunSettings
from mixtrain.records.tunables import Tunables
from mixtrain.worker import evaluation


class Evaluator:
    """Decides when the held-out set is evaluated, runs it (a worker lost meanwhile is recovered from) and records
    each evaluation: in `evals`, metrics.jsonl (`eval`, which the callbacks hear) and on the terminal."""

    def __init__(
        self,
        port: GroupPort,
        settings: RunSettings,
        tunables: Tunables,
        steps: Steps,
        changes: Changes,
        *,
        log: RunLog,
        view: ProgressView,
    ) -> None:
        self.port = port
        self.members = port.members
        self.settings = settings
        self.tunables = tunables
        self.steps = steps
        self.changes = changes
        self.log = log
        self.view = view
        self.evals: list[dict[str, Any]] = []
        self.evaluated_at: int | None = None
        """The global step of the last evaluation (none twice at one step)."""

    def due(self, epoch: int, step: int, last: bool = False) -> bool:
        """After `step` steps of `epoch`: every RunConfig.eval_every steps, or at each epoch's end (Steps.eval_due);
        and at the run's last point (`last`) whenever there is held-out data."""
        return self.steps.eval_due(epoch, step) or bool(last and self.settings.num_eval)

    def run(self, where: Position, at: Position, line: str = "") -> dict[str, Any] | Train | None:
        """The held-out metrics after `where` = (epoch, steps done in it), shown after `line` (the epoch's); `at`:
        where training goes on. None when this step was evaluated already (an epoch's end that is also an
        eval_every point), or where training goes on when a recovery took it back to the last checkpoint."""
        step = self.steps.at(*where)
        if self.evaluated_at == step:
            if line:
                self.view.log(line)
            return None
        ev = self.changes.surviving("evaluate", self.evaluate, at)
        if isinstance(ev, Train):
            return ev
        ev.update(epoch=where[0], step=where[1], global_step=step)
        self.evaluated_at = step
        self.evals.append(ev)
        self.log.write("eval", ev)
        line = f"{line}  held-out loss" if line else f"held-out after step {step}: loss"
        line += f" {ev['loss']:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in ev.items() if k not in ("loss", *EVAL_KEYS))
        self.view.log(line)
        return ev

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, each worker taking a contiguous slice of the eval set sized by its speed
        (schedule.eval_split) in batches its memory allows; what a worker could not fit goes to the others."""
        bounds, timeout = eval_split(
            self.settings.num_eval,
            len(self.members),
            self.members.speeds(),
            self.tunables.collective_timeout_s,
            self.tunables.round_timeout_s,
        )
        batches = eval_batches(self.members.memory_caps())
        parts = self.port.evaluate(bounds, batches, timeout)
        passes, note = evaluation.leftovers(parts, bounds)
        if note:
            self.view.log(note)
            self.log.write("eval_out_of_memory", {"note": note})
        for slices in passes:
            parts += self.port.evaluate(slices, batches, timeout)
        return evaluation.summarize(parts)
