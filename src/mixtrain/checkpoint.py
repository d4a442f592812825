"""Writing weights and training checkpoints atomically, and loading them without running pickled code.

Weights (the final model, and the model part of each checkpoint) are `.safetensors` files: tensors and a
JSON header, nothing that can run, and the format Hugging Face users load everywhere. What is not a
tensor dictionary (optimizer, scheduler, random streams) stays a `torch.save` file, loaded only with
`weights_only=True`. Files written by earlier versions (`model.pt`, checkpoints with one `state.pt`) load
as before.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from mixtrain._checkpoint_folders import MANIFEST_SHA256 as MANIFEST_SHA256  # re-exported: what tests check
from mixtrain._checkpoint_folders import (
    CheckpointError,
    FolderStore,
    Layout,
    opened,
)
from mixtrain._checkpoint_folders import _manifest_digest as _manifest_digest
from mixtrain._files import atomic_write
from mixtrain.errors import InputValueError
from mixtrain.frozen_base import MANIFEST_KEY as FROZEN_BASE
from mixtrain.frozen_base import FrozenBase, trim


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
TASK = Layout(prefix="step-", manifest=MANIFEST, formats=READS, names=(STATE, MODEL), required=(STATE,))
"""The `Task` path's checkpoints in the store both doors share (_checkpoint_folders)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_name(global_step: int) -> str:
    """A checkpoint's folder name in RUN_DIR/checkpoints."""
    return f"step-{global_step:09d}"


class CheckpointStore(FolderStore):
    """`run_dir/checkpoints/step-000000123/{model.safetensors, state.pt, manifest.json}`, the newest `keep` of them,
    in the store both doors share (_checkpoint_folders: atomic folders, manifests with their own SHA-256, files
    opened the run folder's one way, pruning that keeps the newest readable). Weights are a safetensors file; the
    rest loads with weights_only=True, so a file carrying pickled code is refused. Loading falls back to the
    previous checkpoint when the newest fails a check."""

    def __init__(self, run_dir: str | Path, keep: int = 3, base: FrozenBase | None = None) -> None:
        super().__init__(run_dir, keep, TASK)
        self.base = base
        """The model's frozen parameters (a LoRA base): left out of each checkpoint, their fingerprint kept in its
        manifest (frozen_base); None: every parameter trains, the whole model is saved."""

    def save(self, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write `state` (tensors and plain values only) and `meta` (JSON) as checkpoint `meta['global_step']`;
        a model with a frozen base (`self.base`) without it."""
        files: dict[str, Callable[[Any], None]] = {}
        if self.base is not None and isinstance(state.get("model"), dict):
            state = {**state, "model": trim(state["model"], self.base)}
            meta = {**meta, FROZEN_BASE: self.base.manifest()}
        if isinstance(state.get("model"), dict):  # the weights without pickle; the rest keeps torch.save
            weights, other = _split(state["model"])
            data = _safetensors_bytes(weights)
            files[MODEL] = lambda f: f.write(data)
            state = {**state, "model": other}
        files[STATE] = lambda f: _torch_save(state, f)
        return self.write(checkpoint_name(int(meta["global_step"])), files, {"format": FORMAT, **meta})

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """The manifest of the checkpoint at `path` after checking every file; raises CheckpointError."""
        with opened(path, TASK) as (manifest, _):
            return manifest

    @staticmethod
    def read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, manifest) of one checkpoint, verified; pickled code is refused, never run."""
        with opened(path, TASK) as (manifest, files):
            state = _load_state(path, files[STATE])
            if MODEL in files:
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

        def read(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
            state, manifest = self.read(path)
            if accept is not None:
                accept(manifest)
            return state, manifest

        (state, manifest), path = self.first_good(read, warn)
        return state, manifest, path


def _load_state(path: Path, f: Any) -> dict[str, Any]:
    """state.pt from its open, verified file, with weights_only=True."""
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused to load {STATE}: it holds more than tensors and plain values "
            f"(weights_only=True found {str(exc).splitlines()[0][:200]!r}); it was not written by mixtrain"
        ) from None
    except Exception as exc:  # a file that matches its hash but is no torch file: forged, not damaged
        raise CheckpointError(f"{path}: {STATE} is not a torch file ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model", {}), dict):
        raise CheckpointError(f"{path}: {STATE} does not hold a training state (malformed)")
    return state
