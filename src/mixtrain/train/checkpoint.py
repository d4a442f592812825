"""A checkpoint of a loop run: a folder of the user's own files (what `torch.save` wrote), as in Ray Train.

`report(metrics, checkpoint=Checkpoint.from_directory(tmp))` sends the folder's files to the driver, which keeps
them in RUN_DIR/checkpoints/checkpoint-NNNNNN/ (written whole or not at all, each file's SHA-256 in a manifest);
`get_checkpoint()` in a restarted loop gives the newest one back, as a folder on the worker's own machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mixtrain.errors import InputValueError

MAX_FILES = 10_000


class Checkpoint:
    """A folder of files. `from_directory` takes one the loop wrote; `to_directory` / `as_directory` read it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._checked: dict[str, bytes] | None = None
        self._global_batches: list[int] = []

    @classmethod
    def _verified(
        cls, path: str | os.PathLike[str], files: dict[str, bytes], global_batches: list[int] | None = None
    ) -> Checkpoint:
        """A checkpoint of the run folder as the store read and checked it: files() gives those bytes (not the
        folder read again, and not mixtrain's manifest), and the run's global batches it was saved under (a resume
        from it keeps them)."""
        out = cls(path)
        out._checked = dict(files)
        out._global_batches = list(global_batches or [])
        return out

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        if not Path(path).is_dir():
            raise InputValueError(f"Checkpoint.from_directory({str(path)!r}): no such folder")
        return cls(path)

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """The checkpoint's files copied into `path` (a new temporary folder when None); returns the folder."""
        target = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="mixtrain-checkpoint-"))
        shutil.copytree(self.path, target, dirs_exist_ok=True)
        return str(target)

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        """The checkpoint as a local folder, for the block (here it always is one)."""
        yield self.path

    def files(self) -> dict[str, bytes]:
        """Every regular file of the folder by its relative path (links are not followed)."""
        if self._checked is not None:
            return dict(self._checked)
        root = Path(self.path)
        out: dict[str, bytes] = {}
        for file in sorted(root.rglob("*")):
            if file.is_symlink() or not file.is_file():
                continue
            if len(out) >= MAX_FILES:
                raise InputValueError(f"checkpoint {self.path}: more than {MAX_FILES} files")
            out[file.relative_to(root).as_posix()] = file.read_bytes()
        return out

    def __repr__(self) -> str:
        return f"Checkpoint(path={self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and Path(other.path) == Path(self.path)

    def __hash__(self) -> int:
        return hash(self.path)


def write_files(files: dict[str, bytes], folder: Path) -> None:
    """`files` (relative path -> bytes) into `folder`; a name that would leave it is refused."""
    for name, data in files.items():
        target = (folder / name).resolve()
        if not target.is_relative_to(folder.resolve()) or name.startswith("/"):
            raise InputValueError(f"checkpoint file name {name!r} leaves its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
