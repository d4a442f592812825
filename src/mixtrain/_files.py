"""Files written atomically: a crash or a full disk leaves the previous file, never half of one. No torch here:
the cluster commands use it too."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Any], None]) -> Path:
    """`write(file)` into a temporary file in the same folder, fsync, rename, fsync the folder:
    a crash leaves either the old file or the new one, never half of one. The file is always a new one,
    private to its owner (mode 0600, as mkstemp creates it), whatever mode or symlink was at `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(obj: Any, path: str | Path) -> Path:
    """A JSON file written atomically (a full disk or a crash leaves the previous file, never half of one)."""
    text = json.dumps(obj, indent=2) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))
