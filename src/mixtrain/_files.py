"""Files written atomically: a crash or a full disk leaves the previous file, never half of one. No torch here:
the cluster commands use it too."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixtrain.errors import InputValueError


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


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # Linux and macOS; Windows has no symlink attack of this kind
_BY_DESCRIPTOR = {os.open, os.rename, os.unlink} <= os.supports_dir_fd and hasattr(os, "O_DIRECTORY")
"""Files can be made relative to an open folder (POSIX): a folder swapped for a symlink later is not followed."""


class PrivateFolder:
    """A folder written into without following a symlink planted in it or in its place (e.g. someone else's
    run folder that `mixtrain report` writes into). Opened once, without following a symlink at `path`
    (ValueError: one clear line); every file is then made relative to that open folder, new and private
    (0600), and a symlink at a file's name is replaced, never written through. Use as a context manager."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a dangling symlink, or a file: said below
            pass
        if self.path.is_symlink():
            raise InputValueError(
                f"{self.path} is a symlink (to {os.readlink(self.path)}); refusing to write through it: "
                "remove it, or name another folder"
            )
        if not self.path.is_dir():
            raise InputValueError(f"{self.path} is not a folder; remove it, or name another folder")
        self.fd: int | None = None
        if _BY_DESCRIPTOR:  # raises if it became a symlink since the check above
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)

    def __enter__(self) -> PrivateFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def write(self, name: str, write: Callable[[Any], None]) -> Path:
        """`write(file)` into a new private file, renamed over `name` (atomic_write, relative to the folder)."""
        _plain_name(name)
        if self.fd is None:
            return atomic_write(self.path / name, write)
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)
            raise
        os.fsync(self.fd)
        return self.path / name

    def create(self, name: str, data: bytes) -> bool:
        """`data` into a new private file `name`; False, and nothing touched, when anything is there already
        (a file, or a symlink, dangling or not)."""
        _plain_name(name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
        try:
            fd = (
                os.open(name, flags, 0o600, dir_fd=self.fd)
                if self.fd is not None
                else os.open(self.path / name, flags, 0o600)
            )
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True


def _plain_name(name: str) -> None:
    """A file name with no folder in it (it may come from another process)."""
    if name in ("", ".", "..") or os.sep in name or (os.altsep is not None and os.altsep in name):
        raise ValueError(f"{name!r} is not a plain file name")
