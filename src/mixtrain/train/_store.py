"""The checkpoints of a loop run: RUN_DIR/checkpoints/checkpoint-NNNNNN/, each the user's files and a manifest
(each file's size and SHA-256, the report it came with), written into a hidden folder, fsynced, renamed into place;
the newest `keep` kept. Loading checks every file and falls back to the previous checkpoint when one fails."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mixtrain._files import fsync_dir
from mixtrain.train.checkpoint import write_files

MANIFEST = "mixtrain_checkpoint.json"
PREFIX = "checkpoint-"


class LoopCheckpoints:
    def __init__(self, run_dir: str | Path, keep: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def paths(self) -> list[Path]:
        """Finished checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob(f"{PREFIX}*") if p.is_dir() and not p.is_symlink()]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def save(self, files: dict[str, bytes], meta: dict[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        number = 1 + max(
            (int(p.name[len(PREFIX) :]) for p in self.paths() if p.name[len(PREFIX) :].isdigit()), default=0
        )
        final = self.root / f"{PREFIX}{number:06d}"
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
        try:
            write_files(files, tmp)
            entries = {}
            for name, data in files.items():
                with open(tmp / name, "rb+") as f:
                    os.fsync(f.fileno())
                entries[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            with open(tmp / MANIFEST, "w") as f:
                json.dump({"files": entries, **meta}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.root)
        for old in self.paths()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> tuple[Path, dict[str, bytes]] | None:
        """The newest checkpoint whose files all match their manifest, with its files; None when there is none."""
        for path in self.paths():
            files = _verified(path)
            if files is not None:
                return path, files
        return None


def _verified(path: Path) -> dict[str, bytes] | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        out = {}
        for name, entry in manifest["files"].items():
            data = (path / name).read_bytes()
            if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return None
            out[name] = data
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
