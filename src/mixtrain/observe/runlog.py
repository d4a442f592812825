"""The run folder: resolved config, metrics.jsonl, final weights. (TensorBoard files: mixtrain.loggers.)"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from mixtrain.config import RunConfig
from mixtrain.errors import InputValueError

RUN_FILES = ("metrics.jsonl", "checkpoints", "model.safetensors", "model.pt")
"""What a run leaves in its folder; a folder holding any of them belongs to that run."""


def new_run_name() -> str:
    """A default run name: the start time and a random suffix (two runs started in the same second differ)."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def check_new_run_dir(path: Path) -> None:
    """Refuse a folder that already holds a run: its checkpoints, metrics and weights would mix with (or be
    pruned by) this run's. The fix is in the message."""
    held = [name for name in RUN_FILES if os.path.lexists(path / name)]  # a link counts, even a dangling one
    if held:
        raise InputValueError(
            f"run folder {str(path)!r} already holds a run ({', '.join(held)}); continue that run with "
            f"`mixtrain train --resume {path}` (or fit(resume=...)), or give a new --run-dir / RunConfig(run_dir=...)"
        )


NEW_NAME_TRIES = 100
"""Default run names tried before giving up: each has a random suffix, so one clash is already rare."""


def make_run_dir(run: RunConfig, resuming: bool = False) -> Path:
    """The run's folder, created: RunConfig.run_dir, storage_path/name, or storage_path/<new name>. A folder
    that holds another run is refused unless this run continues it (`resuming`)."""
    if run.run_dir is not None or run.name is not None:
        path = Path(run.run_dir) if run.run_dir is not None else Path(run.storage_path) / str(run.name)
        if not resuming:
            check_new_run_dir(path)
        what = f"RunConfig.run_dir={run.run_dir!r}" if run.run_dir is not None else f"RunConfig.name={run.name!r}"
        make_folder(path, what)
        _check_checkpoints_folder(path)
        return path.resolve()
    storage = Path(run.storage_path)
    make_folder(storage, f"RunConfig.storage_path={run.storage_path!r}")
    for _ in range(NEW_NAME_TRIES):  # a default name is never reused, even by a run started at the same moment
        path = storage / new_run_name()
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path.resolve()
    raise InputValueError(
        f"RunConfig.storage_path={run.storage_path!r}: {NEW_NAME_TRIES} new run names in a row already existed in "
        f"{storage}; give a run folder of your own (--run-dir / RunConfig(run_dir=...))"
    )


def make_folder(path: Path, what: str) -> None:
    """mkdir -p, and a clear InputValueError where something other than a folder is in the way: mkdir reports a file
    or a dangling symbolic link there as FileExistsError, which is no name clash."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        pass
    else:
        return
    blocker = next((p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir()), path)
    if blocker.is_symlink() and not blocker.exists():
        kind = f"a symbolic link to {os.readlink(blocker)!r}, which does not exist"
        fix = "remove the link or create the folder it points to"
    else:
        kind, fix = "not a folder", "move it away"
    raise InputValueError(
        f"{what}: {str(blocker)!r} is {kind}, so the run folder {str(path)!r} cannot be made there; {fix}, or "
        "give another run folder (--run-dir / RunConfig(run_dir=...) or RunConfig.storage_path)"
    )


def _check_checkpoints_folder(path: Path) -> None:
    """A run writes and prunes its checkpoints in a folder of its own: a `checkpoints` link in a run folder
    (someone else's, or a planted one) would send those writes and deletes elsewhere."""
    link = path / "checkpoints"
    if link.is_symlink():
        raise InputValueError(
            f"run folder {str(path)!r}: its checkpoints folder is a symbolic link (to {os.readlink(link)!r}); "
            "mixtrain writes and deletes checkpoints only in a folder of the run itself. Replace the link by a "
            "folder, or give a new run folder (--run-dir / RunConfig(run_dir=...)) on the disk it pointed to"
        )


def plain(obj: Any, text: Callable[[Any], str] = repr) -> Any:
    """Dataclasses, tuples and dicts as JSON values (dicts, lists, strings, numbers); anything else as `text`
    makes it (repr in config.json and metrics.jsonl; the loggers take str)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: plain(v, text) for k, v in asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, text) for v in obj]
    if isinstance(obj, dict):
        return {str(k): plain(v, text) for k, v in obj.items()}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return text(obj)


def samples_seen(record: dict[str, Any], num_samples: int, global_batch: int) -> int:
    """Training samples used up to the end of a round or an evaluation. From (epoch, step), not a running sum,
    so a resumed run that repeats rounds after its checkpoint counts them once."""
    if record.get("kind") == "eval" or "first_step" not in record:
        if "step" not in record:  # an evaluation at an epoch's end (written so before eval_every)
            return (record["epoch"] + 1) * num_samples
        return record["epoch"] * num_samples + min(num_samples, record["step"] * global_batch)
    end = record["first_step"] + record["num_steps"]
    return record["epoch"] * num_samples + min(num_samples, end * global_batch)


class RunLog:
    """Appends one JSON line per event to metrics.jsonl (the callbacks, TensorBoard's among them, hear each line)."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        from mixtrain._files import RunFolder

        self.run_dir = run_dir
        with RunFolder(run_dir) as folder:  # a link or a pipe planted at either name is refused, its target untouched
            folder.write_json("config.json", plain(config))
            self._metrics = folder.append("metrics.jsonl")
        self.write_error: OSError | None = None
        """The first error writing metrics.jsonl (a full disk): later lines are dropped, training goes on."""

    def write(self, kind: str, record: dict[str, Any]) -> None:
        line = {"kind": kind, "time": time.time(), **plain(record)}
        try:
            if self.write_error is None:
                self._metrics.write(json.dumps(line) + "\n")
        except OSError as exc:  # a full disk must not end a healthy run: the records are a by-product
            self.write_error = self.write_error or exc

    def close(self) -> None:
        try:
            self._metrics.close()
        except OSError as exc:
            self.write_error = self.write_error or exc
