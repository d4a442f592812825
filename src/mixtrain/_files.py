"""Files written atomically: a crash or a full disk leaves the previous file, never half of one. No torch here:
the cluster commands use it too."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mixtrain._constants import RUN_FILE_MAX_MB, env_float
from mixtrain.errors import InputValueError

if TYPE_CHECKING:  # Python 3.11's; the annotations are not evaluated
    from typing import Self


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
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BY_DESCRIPTOR = {os.open, os.rename, os.unlink, os.mkdir} <= os.supports_dir_fd and hasattr(os, "O_DIRECTORY")
"""Files can be made relative to an open folder (POSIX): a folder swapped for a symlink later is not followed."""
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


def _what(path: Path) -> str:
    """What is at `path` instead of a folder or a regular file, for a one-line message."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to {os.readlink(path)!r})"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file"


class NotAPlainEntry(InputValueError):
    """A link, a pipe, a device or a folder where a run folder's file (or a folder, `wanted`) belongs."""

    def __init__(self, path: Path, wanted: str) -> None:
        self.what = _what(path)
        super().__init__(
            f"{path} is {self.what}, not {wanted}: mixtrain opens a run folder's files without following a link "
            "and reads or appends only regular files; remove it (or move the run folder's real file back in its place)"
        )


class RunFolder:
    """A run folder's files, opened one way for every read and write (metrics.jsonl, config.json, command.json,
    logs/, tensorboard/, the loggers' stores, checkpoints, the report's inputs and outputs).

    The folder is opened once; every name below it is opened relative to that open folder, one component at a
    time, without following a symbolic link at any level (a link planted at `logs` or at `metrics.jsonl` is
    refused, its target untouched). Files are opened non-blocking and checked to be regular files before use (a
    named pipe or a device never blocks a read or a resume), whole reads are bounded, new files are 0600 and new
    folders 0700, and a file is appended to only when it is a regular file. A link or a pipe where a file
    belongs is an InputValueError naming it (one line, exit 2 in the CLI). `path` itself is the user's choice:
    a link there is followed (`PrivateFolder`, for folders others may have made, refuses it). Use as a context
    manager."""

    def __init__(self, path: str | Path, create: bool = False, *, _follow: bool = True) -> None:
        self.path = Path(path)
        if create:
            _make_folder(self.path)
        self.fd: int | None = None
        if _BY_DESCRIPTOR:  # PrivateFolder: raises if `path` became a symlink since its check
            self.fd = os.open(self.path, _DIR & ~_NOFOLLOW if _follow else _DIR)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # ---- folders ------------------------------------------------------------------------------------
    def _parent(self, name: str, make: bool = False) -> tuple[int | None, str]:
        """(an open descriptor of `name`'s folder, its last component); the caller closes the descriptor unless
        it is the run folder's own. Each folder on the way is opened without following a link (`make`: made 0700
        where missing)."""
        parts = relative_parts(name)
        if self.fd is None:
            for i in range(1, len(parts)):
                self._check_folder(self.path.joinpath(*parts[:i]), make)
            return None, parts[-1]
        fd = self.fd
        for i, part in enumerate(parts[:-1]):
            try:
                if make:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                inner = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                self._release(fd)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotAPlainEntry(self.path.joinpath(*parts[: i + 1]), "a folder") from None
                raise
            self._release(fd)
            fd = inner
        return fd, parts[-1]

    def _check_folder(self, path: Path, make: bool) -> None:
        """Without descriptors (Windows): the same checks by name."""
        if make and not os.path.lexists(path):
            path.mkdir(mode=0o700)
        if path.is_symlink() or not path.is_dir():
            raise NotAPlainEntry(path, "a folder")

    def _release(self, fd: int | None) -> None:
        if fd is not None and fd != self.fd:
            os.close(fd)

    def folder(self, name: str) -> Path:
        """The folder `name` in the run folder (made 0700 where missing, each level), never through a link: its
        path, for a writer that takes one (TensorBoard's, MLflow's store)."""
        fd, _ = self._parent(f"{name}/_", make=True)
        self._release(fd)
        return self.path / name

    # ---- files --------------------------------------------------------------------------------------
    def open(self, name: str, flags: int = os.O_RDONLY, make: bool = False) -> int:
        """A descriptor of the regular file `name` (os.open's `flags`; a new one is 0600), never through a link,
        never a pipe or a device; FileNotFoundError where it (or a folder on the way) is missing."""
        fd, last = self._parent(name, make=make)
        try:
            opened = os.open(
                last if fd is not None else self.path / name,
                flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC,
                0o600,
                **({"dir_fd": fd} if fd is not None else {}),
            )
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
                raise NotAPlainEntry(self.path / name, "a regular file") from None
            raise
        finally:
            self._release(fd)
        if not stat.S_ISREG(os.fstat(opened).st_mode):
            os.close(opened)
            raise NotAPlainEntry(self.path / name, "a regular file")
        if _NONBLOCK:
            os.set_blocking(opened, True)
        return opened

    def read(self, name: str, max_bytes: int | None = None) -> bytes:
        """The whole of the regular file `name`; an InputValueError past `max_bytes` (MIXTRAIN_RUN_FILE_MAX_MB)."""
        limit = max_bytes if max_bytes is not None else int(env_float(RUN_FILE_MAX_MB) * 2**20)
        with os.fdopen(self.open(name), "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise InputValueError(
                f"{self.path / name} holds over {limit} bytes, more than a run folder's {name} may: move it away, "
                "or raise MIXTRAIN_RUN_FILE_MAX_MB"
            )
        return data

    def read_json(self, name: str, max_bytes: int | None = None) -> Any:
        """The JSON value in `name`, read as `read` does; malformed JSON is an InputValueError naming the file."""
        try:
            return json.loads(self.read(name, max_bytes))
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, InputValueError):
                raise
            raise InputValueError(f"{self.path / name} is not valid JSON ({exc}); move it away") from None

    def append(self, name: str) -> IO[str]:
        """`name` opened for appending text, line-buffered; made 0600 where missing, and only ever a regular file."""
        return os.fdopen(self.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, make=True), "a", buffering=1)

    def write(self, name: str, write: Callable[[Any], None]) -> Path:
        """`write(file)` into a new private file (0600) renamed over `name`: a crash leaves the old file or the new
        one, and a link at `name` is replaced, never written through."""
        fd, last = self._parent(name, make=True)
        try:
            if fd is None:
                return atomic_write(self.path / name, write)
            _write_at(fd, last, write)
        except (IsADirectoryError, NotADirectoryError):  # a folder where the file belongs: left as it is
            raise NotAPlainEntry(self.path / name, "a regular file") from None
        finally:
            self._release(fd)
        return self.path / name

    def write_json(self, name: str, obj: Any) -> Path:
        text = json.dumps(obj, indent=2) + "\n"
        return self.write(name, lambda f: f.write(text.encode()))

    def create(self, name: str, data: bytes) -> bool:
        """`data` into a new private file `name`; False, and nothing touched, when anything is there already
        (a file, or a symlink, dangling or not). `name` is a plain file name (it may come from another process)."""
        if len(relative_parts(name)) > 1:
            raise InputValueError(f"{name!r} is not a plain file name")
        fd, last = self._parent(name, make=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        try:
            made = os.open(last, flags, 0o600, dir_fd=fd) if fd is not None else os.open(self.path / name, flags, 0o600)
        except FileExistsError:
            return False
        finally:
            self._release(fd)
        with os.fdopen(made, "wb") as f:
            f.write(data)
        return True

    def copy_out(self, name: str, target: Path) -> Path:
        """The regular file `name` copied into `target` (a new private file, 0600), for a tool that takes a path
        (MLflow's artifacts): what it copies on is this file, never a link's target."""
        with os.fdopen(self.open(name), "rb") as src:
            atomic_write(target, lambda f: shutil.copyfileobj(src, f, 1 << 20))
        return target


def _write_at(fd: int, name: str, write: Callable[[Any], None]) -> None:
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    made = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=fd)
    try:
        with os.fdopen(made, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        raise
    os.fsync(fd)


def _make_folder(path: Path) -> None:
    """mkdir -p with new folders 0700 (the ones above the run folder are the user's: as their umask makes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


def relative_parts(name: str) -> list[str]:
    """A name inside a folder, as its components: never absolute, never `..`, `.` or empty, no backslash or NUL (it
    may come from a file someone else wrote: a checkpoint's manifest, another process)."""
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise InputValueError(f"{name!r} is not a name inside a run folder (absolute, empty, or with . or ..)")
    return parts


class PrivateFolder(RunFolder):
    """A folder written into without following a symlink planted in it or in its place (e.g. someone else's
    run folder that `mixtrain report` writes into): as RunFolder, and a symlink at `path` itself is refused
    (one clear line)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            _make_folder(path)
        except FileExistsError:  # a dangling symlink, or a file: said below
            pass
        if path.is_symlink():
            raise InputValueError(
                f"{path} is a symlink (to {os.readlink(path)}); refusing to write through it: "
                "remove it, or name another folder"
            )
        if not path.is_dir():
            raise InputValueError(f"{path} is not a folder; remove it, or name another folder")
        super().__init__(path, _follow=False)
