"""The checkpoints of a loop run: RUN_DIR/checkpoints/checkpoint-NNNNNN/, each the user's own files (as their loop
wrote them, readable where they are) and a manifest, in the store both doors share (_checkpoint_folders): written
whole or not at all, a manifest with each file's size and SHA-256 and its own, names only inside the folder, files
opened without following a link or blocking on a pipe, pruning that keeps the newest readable. Loading checks every
file and falls back to the previous checkpoint when one fails, saying which and why."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mixtrain._checkpoint_folders import CheckpointError, FolderStore, Layout, Writer, check_relative, opened

MANIFEST = "mixtrain_checkpoint.json"
PREFIX = "checkpoint-"
FORMAT = 1
LOOP = Layout(prefix=PREFIX, manifest=MANIFEST, formats=(None, FORMAT), names=None)
"""A loop's checkpoints: any file names inside the folder (not the manifest's); format None: written before the
store was shared (no manifest hash then)."""

log = logging.getLogger("mixtrain")


class LoopCheckpoints:
    def __init__(self, run_dir: str | Path, keep: int) -> None:
        self.store = FolderStore(run_dir, keep, LOOP)
        self.root = self.store.root

    def paths(self) -> list[Path]:
        """Checkpoints, newest first (one that cannot be read first, so loading reports it)."""
        return self.store.paths()

    def save(self, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
        """The loop's `files` (relative name -> bytes) and `meta` (JSON) as the next checkpoint-NNNNNN."""
        # A file named as the manifest is an earlier checkpoint's, copied along by a loop that saved into the
        # folder get_checkpoint() gave it: the store writes this checkpoint's own.
        files = {name: data for name, data in files.items() if name != MANIFEST}
        for name in files:
            check_relative(name)
        numbers = [int(p.name[len(PREFIX) :]) for p in self.paths() if p.name[len(PREFIX) :].isdigit()]
        writers: dict[str, Writer] = {name: _writer(data) for name, data in files.items()}
        return self.store.write(f"{PREFIX}{1 + max(numbers, default=0):06d}", writers, {"format": FORMAT, **meta})

    def latest(self) -> tuple[Path, dict[str, bytes], list[int]] | None:
        """The newest checkpoint whose files all match their manifest, with its files and the run's global batches
        it was saved under (see global_batches); None when there is none. Each one skipped is said (a log warning)
        with why."""
        try:
            (files, batches), path = self.store.first_good(_read, lambda message: log.warning("%s", message))
        except CheckpointError:
            return None
        return path, files, batches


def _writer(data: bytes) -> Writer:
    return lambda f: f.write(data)


def _read(path: Path) -> tuple[dict[str, bytes], list[int]]:
    with opened(path, LOOP) as (manifest, files):
        return {name: f.read() for name, f in files.items()}, global_batches(manifest)


def global_batches(manifest: dict[str, Any]) -> list[int]:
    """The global batch of each of the loop's prepared loaders when the checkpoint was saved (a resume keeps them,
    as a restart within the run does); [] where the manifest has none (a checkpoint from before they were kept) or
    holds anything but a short list of positive integers (then the resumed loop's loaders set them again)."""
    found = manifest.get("global_batches")
    if not isinstance(found, list) or len(found) > 1000:
        return []
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b < 2**40 for b in found):
        return []
    return list(found)
