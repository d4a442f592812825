"""Writing a checkpoint when the disk may be full: make room, try again, and otherwise go on training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixtrain.checkpoint import CheckpointStore
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog


def save_making_room(
    store: CheckpointStore,
    state: dict[str, Any],
    meta: dict[str, Any],
    log: RunLog,
    view: ProgressView,
    last_good: Path | None,
) -> Path | None:
    """Save; on a full disk (or another write error) drop the older checkpoints and try once more, then go on
    without this one (None): the last good checkpoint stays, and a later save may find room."""
    try:
        return store.save(state, meta)
    except OSError as exc:
        first = exc
    dropped = store.prune(keep=1)
    view.log(f"checkpoint failed ({first.strerror or first}); removed {len(dropped)} older checkpoint(s) to make room")
    try:
        return store.save(state, meta)
    except OSError as exc:
        kept = last_good or "none"
        view.log(f"checkpoint skipped ({exc.strerror or exc}); training goes on, the last good one: {kept}")
        log.write("checkpoint_failed", {"error": str(exc), "last_checkpoint": str(kept)})
        return None
