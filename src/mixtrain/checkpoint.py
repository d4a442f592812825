"""Writing weights and training checkpoints atomically, and loading them without running pickled code.

Weights (the final model, and the model part of each checkpoint) are `.safetensors` files: tensors and a
JSON header, nothing that can run, and the format Hugging Face users load everywhere. What is not a
tensor dictionary (optimizer, scheduler, random streams) stays a `torch.save` file, loaded only with
`weights_only=True`. Files written by earlier versions (`model.pt`, checkpoints with one `state.pt`) load
as before.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from mixtrain._files import atomic_write, fsync_dir
from mixtrain.errors import InputValueError


def _torch_save(obj: Any, f: Any) -> None:
    """torch.save, but a write error (a full disk) surfaces as the OSError it is: torch's zip writer raises its
    own RuntimeError ("unexpected pos") on the way out, which would hide it."""
    try:
        torch.save(obj, f)
    except RuntimeError as exc:
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None
        raise


def atomic_save(obj: Any, path: str | Path) -> Path:
    """torch.save, atomically (for what is not a tensor dictionary; weights go through save_weights)."""
    return atomic_write(path, lambda f: _torch_save(obj, f))


_EXTRA = "mixtrain.extra"
"""safetensors metadata key: a state_dict's entries that are not tensors, as JSON."""


def _split(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors on the CPU, the other entries). Tensors that share memory (tied weights) are copied apart:
    safetensors stores each tensor once and refuses aliases."""
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, Any] = {}
    seen: set[int] = set()
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            other[key] = value
            continue
        t = value.detach().to("cpu").contiguous()
        storage = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if storage in seen else t
        seen.add(storage)
    return tensors, other


def _safetensors_bytes(state_dict: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    tensors, other = _split(state_dict)
    try:
        extra = json.dumps(other)
    except TypeError:
        bad = next(k for k, v in other.items() if not _json_ok(v))
        raise InputValueError(
            f"state_dict entry {bad!r} is a {type(other[bad]).__name__}: a weights file holds tensors (and JSON "
            "values); make it a tensor or a number"
        ) from None
    return save(tensors, {_EXTRA: extra} if other else None)


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except TypeError:
        return False
    return True


def save_weights(state_dict: dict[str, Any], path: str | Path) -> Path:
    """A state_dict as a .safetensors file, atomically; load it with load_weights (or safetensors itself)."""
    data = _safetensors_bytes(state_dict)
    return atomic_write(path, lambda f: f.write(data))


class WeightsNotSaved(OSError):
    """The final weights could not be written (a full disk, a lost mount). `state_dict` holds them in memory;
    the message says where the last good checkpoint is."""

    def __init__(self, message: str, errno_: int | None, state_dict: dict[str, Any]) -> None:
        super().__init__(errno_, message)
        self.state_dict = state_dict

    def __str__(self) -> str:
        return str(self.strerror)


def save_final_weights(
    state_dict: dict[str, Any], run_dir: Path, last_checkpoint: Path | None, say: Callable[[str], None]
) -> Path:
    """RUN_DIR/model.safetensors; when it cannot be written, WeightsNotSaved names the last good checkpoint."""
    path = run_dir / "model.safetensors"
    try:
        save_weights(state_dict, path)
    except OSError as exc:
        where = (
            f"the last good checkpoint, {last_checkpoint}, holds the training state up to where it was written "
            f"(load_weights({str(last_checkpoint)!r}) reads its weights)"
            if last_checkpoint is not None
            else "no checkpoint was written"
        )
        raise WeightsNotSaved(
            f"could not write the final weights to {path}: {exc.strerror or exc}; {where}. Free space there and "
            "train again with --resume, or keep Result/the exception's state_dict",
            exc.errno,
            state_dict,
        ) from exc
    say(f"done: weights in {path}")
    return path


def _is_safetensors(path: Path) -> bool:
    """A safetensors file starts with its header's length (8 bytes, little-endian) and then the JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size


def _read_safetensors(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        out: dict[str, Any] = {key: f.get_tensor(key) for key in f.keys()}
        extra = (f.metadata() or {}).get(_EXTRA)
    if extra:
        out.update(json.loads(extra))
    return out


def load_weights(path: str | Path) -> Any:
    """The weights in `path`: a .safetensors file (what mixtrain writes), or a torch.save file of an earlier
    version, loaded with weights_only=True, which refuses pickled code. A run folder means its final weights."""
    path = Path(path)
    if path.is_dir():
        path = next((p for p in (path / "model.safetensors", path / "model.pt") if p.exists()), path / "model.pt")
    if _is_safetensors(path):
        return _read_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


# ---- training checkpoints: a folder per checkpoint, a manifest with a SHA-256 per file ----------
MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """Where a checkpoint continues and who wrote it; stored in its manifest beside the files' hashes."""

    epoch: int
    step: int
    """Continue at this step of `epoch` (step 0 of the next epoch after an epoch's end)."""
    global_step: int
    shares: list[int]
    """Each worker's share when it was written (balanced shares continue from them)."""
    num_workers: int
    workers: list[dict[str, str]]
    """host, device_name and precision per worker."""
    run_id: str = ""
    """The run that wrote it ("" in checkpoints from before run ids)."""
    global_batch: int = 0
    """The global batch it was trained with: (epoch, step) means these samples only with this batch (0: unknown)."""
    num_samples: int = 0
    """Training samples per epoch it was trained on (0: unknown)."""
    seed: int | None = None
    """RunConfig.seed: it fixes the epochs' sample order (and a job's split of its data); None: unknown."""
    data_fingerprint: str = ""
    """A hash of the in-memory training data's dtypes, shapes and a few rows ("": unknown, or a Dataset)."""

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> CheckpointMeta:
        """The manifest's metadata, checked: a value of the wrong type or out of range is a CheckpointError (the
        checkpoint is skipped), never a TypeError later or a resume at a step that is not in the epoch."""
        if not isinstance(manifest, dict):
            raise CheckpointError("its manifest is not a JSON object (malformed)")
        required = [f for f in fields(cls) if f.default is MISSING]
        missing = [f.name for f in required if f.name not in manifest]
        if missing:
            raise CheckpointError(f"its manifest lacks {', '.join(missing)} (malformed)")
        meta = cls(**{f.name: manifest[f.name] for f in fields(cls) if f.name in manifest})
        problems = meta._problems()
        if problems:
            raise CheckpointError(f"its manifest has {'; '.join(problems)} (malformed)")
        return meta

    def _problems(self) -> list[str]:
        out = [
            f"{name}={value!r}, not an integer >= {low}"
            for name, value, low in (
                ("epoch", self.epoch, 0),
                ("step", self.step, 0),
                ("global_step", self.global_step, 0),
                ("num_workers", self.num_workers, 1),
                ("global_batch", self.global_batch, 0),
                ("num_samples", self.num_samples, 0),
            )
            if not _int_at_least(value, low)
        ]
        if self.seed is not None and not _int_at_least(self.seed, 0):
            out.append(f"seed={self.seed!r}, not an integer >= 0 (or null)")
        if not (isinstance(self.shares, list) and all(_int_at_least(s, 0) for s in self.shares)):
            out.append(f"shares={self.shares!r}, not a list of integers >= 0")
        if not (isinstance(self.workers, list) and all(_str_dict(w) for w in self.workers)):
            out.append(f"workers={self.workers!r}, not a list of objects of strings")
        out += [
            f"{name}={value!r}, not a string"
            for name, value in (("run_id", self.run_id), ("data_fingerprint", self.data_fingerprint))
            if not isinstance(value, str)
        ]
        if not out and self.global_batch and self.num_samples:
            num_steps = -(-self.num_samples // self.global_batch)
            if self.step > num_steps:
                out.append(
                    f"step={self.step}, past the end of its epoch ({num_steps} steps of {self.global_batch} in "
                    f"{self.num_samples} samples)"
                )
        return out


def _int_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _str_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


STATE = "state.pt"
MODEL = "model.safetensors"
"""The model's weights; state.pt holds the rest (optimizer, scheduler, loss scale, random streams)."""
FORMAT = 2
READS = (1, 2)
"""Format 1 (before safetensors): everything in state.pt."""


class CheckpointError(RuntimeError):
    """No checkpoint could be loaded (none there, or every one failed its check); the message says why."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, write: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


MANIFEST_SHA256 = "manifest_sha256"
"""The manifest's key for the SHA-256 of its other keys (as canonical JSON): a manifest damaged or edited since
it was written fails its check like a damaged file (manifests from before it are not checked)."""
_MANIFEST_MAX_BYTES = 1 << 20


def _manifest_digest(manifest: dict[str, Any]) -> str:
    rest = {key: value for key, value in manifest.items() if key != MANIFEST_SHA256}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read_manifest(path: Path) -> Any:
    """The parsed manifest of the checkpoint folder `path`. Only a regular file of at most 1 MiB is read: never
    through a symbolic link, and never a pipe or a device (which could block, or never end)."""
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"{path}: unreadable manifest (not a regular file)")
            data = f.read(_MANIFEST_MAX_BYTES + 1)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise CheckpointError(f"{path}: unreadable manifest ({why})") from None
    if len(data) > _MANIFEST_MAX_BYTES:
        raise CheckpointError(f"{path}: unreadable manifest (over {_MANIFEST_MAX_BYTES} bytes)")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None


def _files(path: Path, manifest: Any) -> dict[str, dict[str, Any]]:
    """The manifest's file entries, after checking its shape and its own hash: a malformed manifest is a
    CheckpointError (the checkpoint is skipped), never a KeyError."""
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: the manifest is not a JSON object (malformed)")
    if MANIFEST_SHA256 in manifest and manifest[MANIFEST_SHA256] != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: the manifest does not match its own SHA-256 (edited or corrupted)")
    if not _int_at_least(manifest.get("saved_seq", 0), 0):  # else it would sort as the newest, or fail to sort
        raise CheckpointError(f"{path}: saved_seq={manifest['saved_seq']!r}, not an integer >= 0 (malformed)")
    if manifest.get("format") not in READS:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this mixtrain reads {READS}")
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE not in files:
        raise CheckpointError(f"{path}: the manifest lists no {STATE} (malformed)")
    for name, entry in files.items():
        if name not in (STATE, MODEL) or not isinstance(entry, dict):  # a name is never a path elsewhere
            raise CheckpointError(f"{path}: the manifest's entry {name!r} is not one of its files (malformed)")
        if not _int_at_least(entry.get("bytes"), 0) or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{path}: the manifest's entry for {name} lacks its size or hash (malformed)")
    return files


_UNREADABLE = 2**62
"""The save position given to a checkpoint whose manifest cannot be read: tried first, so loading reports it."""


def _saved_seq(path: Path) -> int | None:
    """The checkpoint's place in its folder's save order (0: written before places were kept); None for what is
    no checkpoint mixtrain can read: a symbolic link, or a folder whose manifest is unreadable or malformed."""
    if path.is_symlink():
        return None
    try:
        manifest = _read_manifest(path)
        _files(path, manifest)
    except CheckpointError:
        return None
    return int(manifest.get("saved_seq", 0))


_TMP = ".tmp-"
"""Prefix of the hidden folders of a checkpoint being written or deleted: loading ignores them, a save removes them."""
REPLACED = ".replaced"
"""Suffix of a checkpoint renamed aside while the same step is written again; deleted once the new one is in
place. A crash before that leaves it, and loading reads it like any other checkpoint."""


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


def checkpoint_name(global_step: int) -> str:
    """A checkpoint's folder name in RUN_DIR/checkpoints."""
    return f"step-{global_step:09d}"


class CheckpointStore:
    """`run_dir/checkpoints/step-000000123/{model.safetensors, state.pt, manifest.json}`, the newest `keep` of them.

    A checkpoint is written into a hidden temporary folder (each file fsynced, the manifest last),
    renamed into place, and the parent folder fsynced: a crash leaves the previous checkpoints and
    at most a temporary folder, which loading ignores and the next save removes. The same step written
    again replaces the old one only once the new one is in place (`_put_in_place`). Loading checks
    every file against the manifest's SHA-256 and falls back to the previous checkpoint when the
    newest fails; tensors load with weights_only=True, so a file carrying pickled code is refused.
    Nothing is written or deleted through a symbolic link.
    """

    def __init__(self, run_dir: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise InputValueError(f"RunConfig.keep_checkpoints={keep}: keep at least 1")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.keep_also: set[str] = set()
        """Checkpoint folder names kept beside the newest `keep` (the best one: RunConfig.keep_best)."""

    def _listing(self) -> list[tuple[Path, int | None]]:
        """Each `step-*` entry with its place in the save order (None: unreadable), newest first."""
        if not self.root.is_dir():
            return []
        found = [(p, _saved_seq(p)) for p in self.root.glob("step-*") if p.is_dir() or p.is_symlink()]
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

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write `state` (tensors and plain values only) and `meta` (JSON) as checkpoint `meta['global_step']`."""
        self._check_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self._clear_temporary()
        final = self.root / checkpoint_name(int(meta["global_step"]))
        seqs = [seq for _, seq in self._listing() if seq is not None]
        meta = {**meta, "saved_seq": 1 + max(seqs, default=0)}
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=_TMP))
        try:
            files = {}
            if isinstance(state.get("model"), dict):  # the weights without pickle; the rest keeps torch.save
                weights, other = _split(state["model"])
                _write_synced(tmp / MODEL, lambda f: f.write(_safetensors_bytes(weights)))
                files[MODEL] = {"sha256": _sha256(tmp / MODEL), "bytes": (tmp / MODEL).stat().st_size}
                state = {**state, "model": other}
            _write_synced(tmp / STATE, lambda f: _torch_save(state, f))
            files[STATE] = {"sha256": _sha256(tmp / STATE), "bytes": (tmp / STATE).stat().st_size}
            manifest = {"format": FORMAT, "files": files, **meta}
            manifest[MANIFEST_SHA256] = _manifest_digest(manifest)
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
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

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of the checkpoint at `path` after checking every file; raises CheckpointError."""
        manifest = _read_manifest(path)
        for name, entry in _files(path, manifest).items():
            file = path / name
            try:
                info = file.lstat()
            except OSError:
                raise CheckpointError(f"{path}: {name} is missing") from None
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{path}: {name} is not a regular file (a link, a pipe or a device)")
            if info.st_size != entry["bytes"]:
                raise CheckpointError(
                    f"{path}: {name} has {info.st_size} bytes, the manifest says {entry['bytes']} (truncated?)"
                )
            if _sha256(file) != entry["sha256"]:
                raise CheckpointError(f"{path}: {name} does not match its SHA-256 in the manifest (corrupted)")
        return manifest

    @staticmethod
    def read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, manifest) of one checkpoint, verified; pickled code is refused, never run."""
        manifest = CheckpointStore.verify(path)
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"{path}: refused to load {STATE}: it holds more than tensors and plain values "
                f"(weights_only=True found {str(exc).splitlines()[0][:200]!r}); it was not written by mixtrain"
            ) from None
        except Exception as exc:  # a file that matches its hash but is no torch file: forged, not damaged
            raise CheckpointError(f"{path}: {STATE} is not a torch file ({exc})") from None
        if not isinstance(state, dict) or not isinstance(state.get("model", {}), dict):
            raise CheckpointError(f"{path}: {STATE} does not hold a training state (malformed)")
        if MODEL in manifest["files"]:
            try:
                state["model"] = {**_read_safetensors(path / MODEL), **state.get("model", {})}
            except Exception as exc:  # safetensors raises its own error types for a damaged header
                raise CheckpointError(f"{path}: {MODEL} is not a valid safetensors file ({exc})") from None
        return state, manifest

    def latest(
        self, warn: Callable[[str], None] = lambda _m: None, accept: Callable[[dict[str, Any]], Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], Path]:
        """The newest checkpoint that passes its checks (and `accept(manifest)`, which raises CheckpointError
        for a manifest it cannot use); each one skipped is reported through `warn`."""
        problems = []
        for path in self.paths():
            try:
                if path.is_symlink():
                    raise CheckpointError(f"{path}: a symbolic link, not a checkpoint folder (links are not followed)")
                state, manifest = self.read(path)
                if accept is not None:
                    accept(manifest)
            except CheckpointError as exc:
                why = str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}"
                problems.append(why)
                warn(f"checkpoint skipped: {why}; trying the previous one")
                continue
            return state, manifest, path
        detail = "; ".join(problems) if problems else "there are none"
        raise CheckpointError(f"no usable checkpoint in {self.root}: {detail}")
