"""The best checkpoint (RunConfig.keep_best): which evaluation was best so far, and the checkpoint written right
after it. No Ray, no torch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mixtrain.callbacks import metric_value

CHECKPOINT_NAME = re.compile(r"step-\d{9}")
"""How CheckpointStore names a checkpoint folder: the only names a saved "best" may point at."""


@dataclass
class Best:
    metric: str
    mode: str
    value: float | None = None
    name: str | None = None
    """The best checkpoint's folder name in RUN_DIR/checkpoints."""

    def improved(self, metrics: dict[str, float]) -> bool:
        """Whether `metrics` beat the best so far (the first evaluation always does). Raises InputValueError when
        the metric is not among them."""
        value = metric_value(metrics, self.metric, "RunConfig.keep_best")
        if self.value is not None and (value >= self.value if self.mode == "min" else value <= self.value):
            return False
        self.value = value
        return True

    def state(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "name": self.name}

    def load(self, saved: Any) -> None:
        """The best so far from a checkpoint. Taken only for the same metric and mode, and a name that is a
        checkpoint folder's (the file is in a folder others may write: it must not point anywhere else)."""
        if not isinstance(saved, dict) or (saved.get("metric"), saved.get("mode")) != (self.metric, self.mode):
            return
        value, name = saved.get("value"), saved.get("name")
        if isinstance(value, (int, float)) and isinstance(name, str) and CHECKPOINT_NAME.fullmatch(name):
            self.value, self.name = float(value), name
