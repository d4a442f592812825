"""The checkpoint store of both doors: RUN_DIR/checkpoints/<prefix>N/, each a folder of files and a manifest (each
file's size and SHA-256, the manifest's own SHA-256, its place in the save order). What the files hold is the door's
business: checkpoint.py keeps the `Task` path's training state in it, train/_store.py a loop's own files. No torch
here (the loop's report sink uses it).

A checkpoint is written into a hidden temporary folder (each file fsynced, the manifest last), renamed into place,
and the parent folder fsynced: a crash leaves the previous checkpoints and at most a temporary folder, which loading
ignores and the next save removes. Every file is opened the run folder's one way (_files.RunFolder: no link at any
level, no pipe or device, a bounded manifest), a manifest names only files inside its folder, and pruning deletes
only readable checkpoints beyond the newest `keep`, so the newest good one always stays. Nothing is written or
deleted through a symbolic link.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mixtrain._files import NotAPlainEntry, RunFolder, fsync_dir, relative_parts
from mixtrain.errors import InputValueError


class CheckpointError(RuntimeError):
    """No checkpoint could be loaded (none there, or every one failed its check); the message says why."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one door's checkpoints look in RUN_DIR/checkpoints."""

    prefix: str
    """Each checkpoint folder's name starts with it (step-, checkpoint-)."""
    manifest: str
    """The manifest's file name in each folder."""
    formats: tuple[Any, ...]
    """The manifest `format` values this mixtrain reads (None: the key is absent)."""
    names: tuple[str, ...] | None
    """The only file names a manifest may list; None: any name inside the folder (a loop's own files)."""
    required: tuple[str, ...] = ()
    """File names every manifest lists."""


MANIFEST_SHA256 = "manifest_sha256"
"""The manifest's key for the SHA-256 of its other keys (as canonical JSON): a manifest damaged or edited since
it was written fails its check like a damaged file (manifests from before it are not checked)."""
_MANIFEST_MAX_BYTES = 1 << 20
_UNREADABLE = 2**62
"""The save position given to a checkpoint whose manifest cannot be read: tried first, so loading reports it."""
_TMP = ".tmp-"
"""Prefix of the hidden folders of a checkpoint being written or deleted: loading ignores them, a save removes them."""
REPLACED = ".replaced"
"""Suffix of a checkpoint renamed aside while the same name is written again; deleted once the new one is in
place. A crash before that leaves it, and loading reads it like any other checkpoint."""


def _int_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _manifest_digest(manifest: dict[str, Any]) -> str:
    rest = {key: value for key, value in manifest.items() if key != MANIFEST_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _split(path: Path) -> tuple[Path, str]:
    """(the run folder, `checkpoints/<checkpoint>` in it) of the checkpoint folder `path` (relative or not)."""
    where = path.absolute()
    return where.parent.parent, f"{where.parent.name}/{where.name}"


@contextlib.contextmanager
def _in(path: Path) -> Iterator[tuple[RunFolder, str]]:
    """(the run folder opened the one way, the checkpoint's name in it: `checkpoints/<checkpoint>`), so that neither
    a link at `checkpoints` nor one at the checkpoint's own name is followed for a read. Its errors are the
    checkpoint's (CheckpointError)."""
    root, where = _split(path)
    try:
        with RunFolder(root) as folder:
            yield folder, where
    except (OSError, InputValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def read_manifest(path: Path, layout: Layout) -> Any:
    """The parsed manifest of the checkpoint folder `path`: only a regular file of at most 1 MiB, never through a
    symbolic link, never a pipe or a device (which could block, or never end)."""
    root, where = _split(path)
    try:
        with RunFolder(root) as folder:
            data = folder.read(f"{where}/{layout.manifest}", _MANIFEST_MAX_BYTES)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc.strerror or exc})") from None
    except InputValueError as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({_why(exc)})") from None
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None


def _why(exc: InputValueError) -> str:
    if isinstance(exc, NotAPlainEntry):
        return f"{exc.what}, not a regular file" if exc.what != "missing" else "missing"
    return f"over {_MANIFEST_MAX_BYTES} bytes"  # RunFolder.read's other refusal: its size bound


def check_files(path: Path, manifest: Any, layout: Layout) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, after checking its shape and its own hash: a malformed manifest is a
    CheckpointError (the checkpoint is skipped), never a KeyError."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: the manifest is not a JSON object (malformed)")
    if MANIFEST_SHA256 in manifest and manifest[MANIFEST_SHA256] != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: the manifest does not match its own SHA-256 (edited or corrupted)")
    if not _int_at_least(manifest.get("saved_seq", 0), 0):  # else it would sort as the newest, or fail to sort
        raise CheckpointError(f"{path}: saved_seq={manifest['saved_seq']!r}, not an integer >= 0 (malformed)")
    if manifest.get("format") not in layout.formats:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this mixtrain reads {layout.formats}")
    files = manifest.get("files")
    if not isinstance(files, dict) or any(name not in files for name in layout.required):
        raise CheckpointError(f"{path}: the manifest lists no {', '.join(layout.required) or 'files'} (malformed)")
    for name, entry in files.items():
        if not (_own_name(name, layout) and isinstance(entry, dict)):  # a name is never a path elsewhere
            raise CheckpointError(f"{path}: the manifest's entry {name!r} is not one of its files (malformed)")
        if not _int_at_least(entry.get("bytes"), 0) or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{path}: the manifest's entry for {name} lacks its size or hash (malformed)")
    return files


def _own_name(name: Any, layout: Layout) -> bool:
    """A name of a file inside the checkpoint's folder: never absolute, never with `..`, never the manifest."""
    if layout.names is not None:
        return name in layout.names
    if not isinstance(name, str) or name == layout.manifest:
        return False
    try:
        check_relative(name)
    except InputValueError:
        return False
    return True


def check_relative(name: str) -> None:
    """InputValueError for a file name that is not inside its folder (absolute, `..`, `.`, empty parts, NUL)."""
    relative_parts(name)


def saved_seq(path: Path, layout: Layout) -> int | None:
    """The checkpoint's place in its folder's save order (0: written before places were kept); None for what is
    no checkpoint mixtrain can read: a symbolic link, or a folder whose manifest is unreadable or malformed."""
    if path.is_symlink():
        return None
    try:
        manifest = read_manifest(path, layout)
        check_files(path, manifest, layout)
    except CheckpointError:
        return None
    return int(manifest.get("saved_seq", 0))


@contextlib.contextmanager
def opened(path: Path, layout: Layout) -> Iterator[tuple[dict[str, Any], dict[str, IO[bytes]]]]:
    """(manifest, each listed file open and rewound) once every file matches its size and SHA-256; the files are
    the ones checked (opened once, relative to the checkpoints folder, no link, no pipe). CheckpointError else."""
    manifest = read_manifest(path, layout)
    entries = check_files(path, manifest, layout)
    with contextlib.ExitStack() as stack, _in(path) as (folder, where):
        files: dict[str, IO[bytes]] = {}
        for name, entry in entries.items():
            try:
                f = stack.enter_context(os.fdopen(folder.open(f"{where}/{name}"), "rb"))
            except FileNotFoundError:
                raise CheckpointError(f"{path}: {name} is missing") from None
            except InputValueError:
                raise CheckpointError(f"{path}: {name} is not a regular file (a link, a pipe or a device)") from None
            _check(f, path, name, entry)
            files[name] = f
        yield manifest, files


def _check(f: IO[bytes], path: Path, name: str, entry: dict[str, Any]) -> None:
    size = os.fstat(f.fileno()).st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest (corrupted)")
    f.seek(0)


def _delete(path: Path) -> None:
    """Remove what mixtrain wrote at `path`; a symbolic link there is unlinked, never followed."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    except OSError:
        pass  # what is left is hidden (.tmp-*): the next save tries again


def _retire(path: Path) -> bool:
    """Delete the checkpoint at `path`: renamed to a hidden name first, so a crash while deleting leaves a .tmp-*
    folder (ignored, removed by the next save), never a half-deleted checkpoint without its manifest."""
    if path.is_symlink():
        _delete(path)
        return not os.path.lexists(path)
    hidden = path.with_name(f"{_TMP}del-{path.name}-{secrets.token_hex(4)}")
    try:
        os.rename(path, hidden)
        fsync_dir(path.parent)
    except OSError:
        return False
    _delete(hidden)
    return True


Writer = Callable[[IO[bytes]], Any]


class FolderStore:
    """RUN_DIR/checkpoints/<layout.prefix>*, the newest `keep` of them (and those named in `keep_also`)."""

    def __init__(self, run_dir: str | Path, keep: int, layout: Layout) -> None:
        if keep < 1:
            raise InputValueError(f"RunConfig.keep_checkpoints={keep}: keep at least 1")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.layout = layout
        self.keep_also: set[str] = set()
        """Checkpoint folder names kept beside the newest `keep` (the best one: RunConfig.keep_best)."""

    def _listing(self) -> list[tuple[Path, int | None]]:
        """Each checkpoint entry with its place in the save order (None: unreadable), newest first."""
        if not self.root.is_dir():
            return []
        entries = self.root.glob(f"{self.layout.prefix}*")
        found = [(p, saved_seq(p, self.layout)) for p in entries if p.is_dir() or p.is_symlink()]
        return sorted(found, key=lambda e: (_UNREADABLE if e[1] is None else e[1], e[0].name), reverse=True)

    def paths(self) -> list[Path]:
        """Checkpoints, newest first: by the order they were saved (a run that went back to an older checkpoint
        saves lower step numbers after higher ones), then by name (checkpoints from before that). One that
        cannot be read (a symbolic link, an unreadable or malformed manifest) comes first, so loading reports it."""
        return [path for path, _ in self._listing()]

    def _check_root(self) -> None:
        """Writes and deletes happen in a folder of the run itself: a `checkpoints` that is a symbolic link (in a
        run folder someone else made) would point them at files elsewhere."""
        if self.root.is_symlink():
            raise InputValueError(
                f"{self.root} is a symbolic link (to {os.readlink(self.root)}): mixtrain writes and deletes "
                "checkpoints only in a folder of the run itself; replace the link by a folder, or give a new run "
                "folder (--run-dir / RunConfig(run_dir=...)) on the disk it pointed to"
            )

    def _clear_temporary(self) -> None:
        for stale in self.root.glob(f"{_TMP}*"):  # left by a crash while writing or deleting one
            _delete(stale)

    def write(self, name: str, files: dict[str, Writer], meta: dict[str, Any]) -> Path:
        """Checkpoint `name`: each of `files` written by its writer, and a manifest of `meta` (JSON) with each
        file's size and SHA-256, its own SHA-256 and its place in the save order; then the oldest pruned."""
        self._check_root()
        with RunFolder(self.root.parent, create=True) as run:
            run.folder(self.root.name)
        self._clear_temporary()
        seqs = [seq for _, seq in self._listing() if seq is not None]
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=_TMP))
        try:
            with RunFolder(tmp) as folder:
                entries = {file: _write_file(folder, file, write) for file, write in files.items()}
                manifest = {**meta, "files": entries, "saved_seq": 1 + max(seqs, default=0)}
                manifest[MANIFEST_SHA256] = _manifest_digest(manifest)
                text = json.dumps(manifest, indent=1).encode()
                _write_file(folder, self.layout.manifest, lambda f: f.write(text))
            fsync_dir(tmp)
            final = self.root / name
            self._put_in_place(tmp, final)
        except BaseException:
            _delete(tmp)
            raise
        self.prune(self.keep)
        return final

    def _put_in_place(self, tmp: Path, final: Path) -> None:
        """Rename the finished `tmp` to `final`. A checkpoint already there (the same step written again: a
        Ctrl-C right after a resume, every resume of a sharded optimizer) is renamed aside first, and deleted
        only once the new one is in place and the folder synced: a crash at any point leaves a loadable
        checkpoint of this step, the old one (`step-N.replaced`) or the new one."""
        aside = final.with_name(final.name + REPLACED)
        if os.path.lexists(final):
            if os.path.lexists(aside):  # an older copy of this step, left by a crash before its delete
                _retire(aside)
            os.rename(final, aside)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(aside, final)  # an error, not a crash: the old one back in its place
                raise
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        if os.path.lexists(aside):  # renamed aside just now, or left by a crash between the two renames
            _retire(aside)

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the newest `keep` checkpoints and those named in `keep_also` (and unfinished temporary
        folders); returns those deleted.
        Only checkpoints that can be read count: what cannot be (a crash's leftover from an earlier version, a
        damaged manifest, a symbolic link) neither takes a good one's place nor is deleted, so the newest good
        checkpoint always stays."""
        assert keep >= 1, "the newest good checkpoint is never deleted"
        self._check_root()
        self._clear_temporary()
        good = [path for path, seq in self._listing() if seq is not None]
        return [path for path in good[keep:] if path.name not in self.keep_also and _retire(path)]

    def first_good(self, read: Callable[[Path], Any], warn: Callable[[str], None]) -> tuple[Any, Path]:
        """(read(path), path) of the newest checkpoint `read` accepts (it raises CheckpointError for one it cannot
        use); each one skipped is reported through `warn`; CheckpointError when none is left."""
        problems = []
        for path in self.paths():
            try:
                if path.is_symlink():
                    raise CheckpointError(f"{path}: a symbolic link, not a checkpoint folder (links are not followed)")
                return read(path), path
            except CheckpointError as exc:
                why = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"
                problems.append(why)
                warn(f"checkpoint skipped: {why}; trying the previous one")
        detail = "; ".join(problems) if problems else "there are none"
        raise CheckpointError(f"no usable checkpoint in {self.root}: {detail}")


def _write_file(folder: RunFolder, name: str, write: Writer) -> dict[str, Any]:
    """A new file `name` in the checkpoint being written, fsynced; its manifest entry (size, SHA-256)."""
    fd = folder.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, make=True)
    with os.fdopen(fd, "w+b") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        digest = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "bytes": size}
