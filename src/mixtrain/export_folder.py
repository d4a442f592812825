"""Where `mixtrain export PATH --out DIR` writes: never deleting what mixtrain did not write.

DIR is a new folder, an empty one, or one holding a previous export, which a marker file (EXPORT_MARKER, a JSON
list of the files that export wrote) says. Only those files are replaced; anything else a person put there since
(a README, notes) stays. The current folder and a run folder are refused by name: an export there would mix a
model's files with the run's (or with whatever the current folder holds).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from mixtrain.errors import InputValueError

EXPORT_MARKER = ".mixtrain-export"
"""In an export's folder: the names of the files that export wrote (the ones the next export may replace)."""
MARKER_MAX_BYTES = 64 << 10
RUN_MARKS = ("command.json", "metrics.jsonl", "checkpoints")
"""Any of these in a folder: a run folder, not a place for an export (which writes config.json and
model.safetensors itself)."""


def check_out(out: Path, run_dir: Path) -> list[str]:
    """The files of a previous export in `out` (to replace), [] for a new or empty folder; anything else is an
    InputValueError naming the folder and the fix."""
    fix = "name a new or empty folder, e.g. --out hf_export (export deletes nothing it did not write)"
    if out.absolute().resolve() == Path.cwd().resolve():
        raise InputValueError(f"export --out {str(out)!r} is the current folder; {fix}")
    if out.absolute().resolve() == run_dir.absolute().resolve() or any(os.path.lexists(out / n) for n in RUN_MARKS):
        raise InputValueError(f"export --out {str(out)!r} is a run folder; {fix}")
    if not os.path.lexists(out):
        return []
    if out.is_symlink() or not out.is_dir():
        raise InputValueError(f"export --out {str(out)!r} is not a folder (a file or a symlink); {fix}")
    held = sorted(os.listdir(out))
    if not held:
        return []
    if EXPORT_MARKER not in held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise InputValueError(f"export --out {str(out)!r} holds files mixtrain did not write ({shown}); {fix}")
    return _read_marker(out / EXPORT_MARKER, fix)


def _read_marker(path: Path, fix: str) -> list[str]:
    """The marker's file names: a small regular file read without following a link, each a plain name."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
    except OSError as exc:
        raise InputValueError(f"{path}: cannot be read ({exc.strerror}); {fix}") from None
    try:
        info = os.fstat(fd)
        text = os.read(fd, MARKER_MAX_BYTES + 1) if stat.S_ISREG(info.st_mode) else b""
    finally:
        os.close(fd)
    try:
        names = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) and _plain(n) for n in names):
        raise InputValueError(f"{path}: not the list of an export's files; {fix}")
    return names


def _plain(name: str) -> bool:
    return name not in ("", ".", "..", EXPORT_MARKER) and "/" not in name and "\\" not in name and "\0" not in name


def place_export(new: Path, out: Path, previous: list[str]) -> None:
    """Move the files of the finished export `new` into `out`: all at once (a rename) for a new folder; else the
    previous export's files removed, the new ones moved in one by one, and the marker written last."""
    names = sorted(os.listdir(new))
    _write_marker(new, names)
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    clash = [n for n in names if n not in previous and os.path.lexists(out / n)]
    if clash:  # a file of the same name that an earlier export did not write: someone's own, kept
        raise InputValueError(
            f"export --out {str(out)!r} holds {', '.join(clash[:5])}, which mixtrain did not write and this export "
            "would replace; move it aside, or name a new folder"
        )
    for name in previous:
        target = out / name
        if os.path.lexists(target) and (target.is_symlink() or not target.is_dir()):
            os.unlink(target)
    for name in names:
        os.replace(new / name, out / name)
    os.replace(new / EXPORT_MARKER, out / EXPORT_MARKER)
    os.rmdir(new)


def _write_marker(folder: Path, names: list[str]) -> None:
    from mixtrain._files import atomic_write

    text = json.dumps(names) + "\n"
    atomic_write(folder / EXPORT_MARKER, lambda f: f.write(text.encode()))
