"""Writing weights and training checkpoints atomically, and loading them without running pickled code."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    _fsync_dir(path.parent)
    return path


def load_weights(path: str | Path) -> Any:
    """Load a file written by atomic_save; weights_only=True refuses pickled code."""
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

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> CheckpointMeta:
        return cls(**{f.name: manifest[f.name] for f in fields(cls)})


STATE = "state.pt"
FORMAT = 1


class CheckpointError(RuntimeError):
    """No checkpoint could be loaded (none there, or every one failed its check); the message says why."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CheckpointStore:
    """`run_dir/checkpoints/step-000000123/{state.pt, manifest.json}`, the newest `keep` of them.

    A checkpoint is written into a hidden temporary folder (each file fsynced, the manifest last),
    renamed into place, and the parent folder fsynced: a crash leaves the previous checkpoints and
    at most a temporary folder, which loading ignores and the next save removes. Loading checks
    every file against the manifest's SHA-256 and falls back to the previous checkpoint when the
    newest fails; tensors load with weights_only=True, so a file carrying pickled code is refused.
    """

    def __init__(self, run_dir: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"RunConfig.keep_checkpoints={keep}: keep at least 1")
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def paths(self) -> list[Path]:
        """Finished checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step-*") if p.is_dir()), reverse=True)

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write `state` (tensors and plain values only) and `meta` (JSON) as checkpoint `meta['global_step']`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash between write and rename
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step-{int(meta['global_step']):09d}"
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".tmp-"))
        try:
            with open(tmp / STATE, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            manifest = {
                "format": FORMAT,
                "files": {STATE: {"sha256": _sha256(tmp / STATE), "bytes": (tmp / STATE).stat().st_size}},
                **meta,
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # the same step written again (a resumed run): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.root)
        for old in self.paths()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of the checkpoint at `path` after checking every file; raises CheckpointError."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this mixtrain reads {FORMAT}")
        for name, entry in manifest["files"].items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{path}: {name} is missing")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(
                    f"{path}: {name} has {size} bytes, the manifest says {entry['bytes']} (truncated?)"
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
        return state, manifest

    def latest(self, warn: Callable[[str], None] = lambda _m: None) -> tuple[dict[str, Any], dict[str, Any], Path]:
        """The newest checkpoint that passes its checks; each one skipped is reported through `warn`."""
        problems = []
        for path in self.paths():
            try:
                state, manifest = self.read(path)
            except CheckpointError as exc:
                problems.append(str(exc))
                warn(f"checkpoint skipped: {exc}; trying the previous one")
                continue
            return state, manifest, path
        detail = "; ".join(problems) if problems else "there are none"
        raise CheckpointError(f"no usable checkpoint in {self.root}: {detail}")
