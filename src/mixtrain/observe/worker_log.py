"""Worker output goes to the run folder, never to the driver's terminal.

Each worker points its stdout and stderr (file descriptors 1 and 2, so C++ output such as gloo's is
caught too) and mixtrain's log records at one file. A worker on the driver's machine writes straight
into RUN_DIR/logs; one on another machine writes to its own temporary folder, and the driver copies
that file into RUN_DIR/logs when the run ends.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("mixtrain.worker")
MAX_FETCH = 4 * 2**20
"""Bytes of a remote worker's log copied back (its end)."""


def log_path(log_dir: str, driver_node: str, this_node: str, name: str) -> Path:
    """Where this worker writes: the run folder when it shares the driver's node, else a local temp folder."""
    if this_node == driver_node:
        folder = Path(log_dir)
    else:
        folder = Path(tempfile.gettempdir()) / "mixtrain-logs" / Path(log_dir).parent.name
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def redirect_output(path: Path) -> None:
    """Send this process's stdout, stderr and INFO-level mixtrain records to `path` (appending)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("mixtrain")
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def read_tail(path: Path) -> str:
    """The end of a log file, for copying a remote worker's log back."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - MAX_FETCH))
        return f.read().decode("utf-8", errors="replace")
