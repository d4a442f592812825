"""Writing weights atomically and loading them without running pickled code."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save to a temporary file in the same folder, fsync, rename, fsync the folder:
    a crash leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def load_weights(path: str | Path) -> Any:
    """Load a file written by atomic_save; weights_only=True refuses pickled code."""
    return torch.load(path, map_location="cpu", weights_only=True)
