"""Worker output goes to the run folder; a loop's rank 0 also shows its lines on the driver's terminal.

Each worker points its stdout and stderr (file descriptors 1 and 2, so C++ output such as gloo's is
caught too) and mixtrain's log records at one file. A worker on the driver's machine writes straight
into RUN_DIR/logs; one on another machine writes to a private folder of its own under the temporary
folder (`mixtrain-logs-UID`, mode 0700, never one that another user made or a symlink), and the driver
copies that file into RUN_DIR/logs when the run ends. Log files are created 0600 and never opened
through a symlink: a log can hold data and paths, and a predictable name in /tmp is an invitation.

A loop's rank 0 follows its own log file while the loop runs (LogFollower) and sends the new lines to the driver,
which prints them as torchrun prints a rank's output: on whatever node rank 0 runs, from the one file that holds
what it printed, gloo's and C++ output included.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from mixtrain._files import PrivateFolder, RunFolder

log = logging.getLogger("mixtrain.worker")
MAX_FETCH = 4 * 2**20
"""Bytes of a remote worker's log copied back (its end)."""
MAX_FOLLOW = 2**20
"""Bytes of new output a LogFollower reads at one look (the rest at the next)."""
MAX_LINE = 4000
"""Characters of one followed line sent to the driver (a longer one is cut)."""


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


def _private_dir(path: Path) -> bool:
    """Make `path` a folder only this user can enter; False when it is another user's or a symlink."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        return False
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return True


def remote_log_dir(run_name: str) -> Path:
    """This user's private folder for the logs of run `run_name` on a node other than the driver's."""
    base = Path(tempfile.gettempdir()) / f"mixtrain-logs-{_user()}"
    if not _private_dir(base):  # taken by someone else (or a planted link): a fresh private one instead
        base = Path(tempfile.mkdtemp(prefix=f"mixtrain-logs-{_user()}-"))
    folder = base / run_name
    if not _private_dir(folder):
        folder = Path(tempfile.mkdtemp(prefix=f"{run_name}-", dir=base))
    return folder


def log_path(log_dir: str, driver_node: str, this_node: str, name: str) -> Path:
    """Where this worker writes: the run folder when it shares the driver's node, else a private folder here."""
    if this_node == driver_node:  # RUN_DIR/logs, made 0700, refused where it is a link
        with RunFolder(Path(log_dir).parent) as run:
            folder = run.folder(Path(log_dir).name)
    else:
        folder = remote_log_dir(Path(log_dir).parent.name)
    return folder / name


def open_log(path: Path) -> int:
    """A descriptor for appending to `path` (FOLDER/logs/NAME): created 0600, opened relative to FOLDER without
    following a link at `logs` or at NAME, and only a regular file (a planted pipe would block the worker);
    InputValueError otherwise."""
    with RunFolder(path.parent.parent) as folder:
        return folder.open(f"{path.parent.name}/{path.name}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)


_original: tuple[int, int, tuple[list[logging.Handler], int, bool]] | None = None
"""Copies of this process's first stdout and stderr, and the mixtrain logger's first handlers, level and
propagation, taken at the first redirection (restore_output)."""


def redirect_output(path: Path) -> None:
    """Send this process's stdout, stderr and INFO-level mixtrain records to `path` (appending)."""
    global _original
    sys.stdout.flush()
    sys.stderr.flush()
    if _original is None:
        logger = logging.getLogger("mixtrain")
        _original = (os.dup(1), os.dup(2), (list(logger.handlers), logger.level, logger.propagate))
    fd = open_log(path)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger("mixtrain")
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def restore_output() -> None:
    """Undo redirect_output (a kept worker whose next run has no log folder): output goes where it first went."""
    if _original is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(_original[0], 1)
    os.dup2(_original[1], 2)
    logger = logging.getLogger("mixtrain")
    logger.handlers, logger.level, logger.propagate = list(_original[2][0]), _original[2][1], _original[2][2]


def save_copies(log_dir: Path, copies: list[tuple[str, str]]) -> None:
    """Copies of remote workers' logs, (file name, text), into `log_dir` (the run folder's logs): new files,
    0600, never through a symlink (one planted at the name, dangling or not, is left alone, and so is a file
    already there). A name that is not a plain file name is skipped."""
    try:
        folder = PrivateFolder(log_dir)
    except (ValueError, OSError) as exc:  # at shutdown: say so, and let the workers be stopped
        log.warning("the remote workers' logs were not copied: %s", exc)
        return
    with folder:
        for name, text in copies:
            try:
                folder.create(name, text.encode("utf-8", errors="replace"))
            except (ValueError, OSError) as exc:  # a name with a folder in it, a full disk
                log.warning("worker log %r not copied: %s", name, exc)


def read_tail(path: Path) -> str:
    """The end of a log file, for copying a remote worker's log back."""
    with RunFolder(path.parent) as folder, os.fdopen(folder.open(path.name), "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - MAX_FETCH))
        return f.read().decode("utf-8", errors="replace")


class LogFollower:
    """Sends the lines appended to `path` after it was made: a thread looks every `poll_s` and hands the
    complete lines to `send(lines, wait=False)`; `stop()` sends the rest (a last line without its end too) with
    `wait=True` and returns. A carriage return keeps what follows it (a progress bar's last state), as a
    terminal would show it."""

    def __init__(self, path: Path, send: Callable[[list[str], bool], None], poll_s: float) -> None:
        with RunFolder(path.parent) as folder:  # the worker's own log, opened the run folder's one way
            self._fd = folder.open(path.name)
        os.lseek(self._fd, 0, os.SEEK_END)  # what the worker wrote before the loop is not the loop's output
        self._send, self._poll_s = send, poll_s
        self._partial = b""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mixtrain-log-follower", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_s):
            lines = self._new_lines(final=False)
            if lines:
                self._send(lines, False)

    def _new_lines(self, final: bool) -> list[str]:
        data = self._partial + os.read(self._fd, MAX_FOLLOW)
        *complete, self._partial = data.split(b"\n")
        self._partial = self._partial.rsplit(b"\r", 1)[-1][-MAX_LINE * 4 :]  # bounded, whatever is printed
        if final and self._partial:
            complete, self._partial = [*complete, self._partial], b""
        return [line.rsplit(b"\r", 1)[-1].decode("utf-8", errors="replace")[:MAX_LINE] for line in complete]

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        try:
            for _ in range(64):  # what is left, up to 64 MiB; the log file keeps it all
                lines = self._new_lines(final=True)
                if not lines:
                    break
                self._send(lines, True)
        finally:
            os.close(self._fd)
