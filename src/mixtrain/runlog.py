"""The run folder: resolved config, metrics.jsonl, final weights."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from mixtrain.config import RunConfig


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


class RunLog:
    """Appends one JSON line per event to metrics.jsonl."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        (run_dir / "config.json").write_text(json.dumps(_plain(config), indent=2) + "\n")
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self._metrics.write(json.dumps({"kind": kind, "time": time.time(), **_plain(record)}) + "\n")

    def close(self) -> None:
        self._metrics.close()
