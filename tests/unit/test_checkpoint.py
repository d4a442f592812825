import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from mixtrain import load_weights
from mixtrain.checkpoint import STATE, CheckpointError, CheckpointStore, _sha256, atomic_save


def test_atomic_save_round_trip_leaves_no_temp_files(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    path = atomic_save(state, tmp_path / "model.pt")
    assert torch.equal(load_weights(path)["w"], state["w"])
    assert os.listdir(tmp_path) == ["model.pt"]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_load_refuses_pickled_code(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": _Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_weights(path)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


# ---- training checkpoints --------------------------------------------------------------------


def _save(store, step, value):
    return store.save({"model": {"w": torch.full((3,), float(value))}, "epoch": 0}, {"global_step": step, "epoch": 0})


def test_keeps_the_newest_n_and_each_verifies(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (2, 4, 6):
        _save(store, step, step)
    assert [p.name for p in store.paths()] == ["step-000000006", "step-000000004"]
    state, manifest, _ = store.latest()
    assert manifest["global_step"] == 6 and torch.equal(state["model"]["w"], torch.full((3,), 6.0))
    assert len(manifest["files"][STATE]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2)
    newest = _save(store, 4, 4) / STATE
    data = bytearray(newest.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncate":
        newest.write_bytes(bytes(data[: len(data) // 2]))
    else:
        newest.unlink()
    warnings = []
    _, manifest, _ = store.latest(warnings.append)
    assert manifest["global_step"] == 2
    expected = {"corrupt": "does not match its SHA-256", "truncate": "truncated", "delete": "is missing"}[damage]
    assert len(warnings) == 1 and expected in warnings[0] and "step-000000004" in warnings[0]


def test_no_usable_checkpoint_says_why(tmp_path):
    with pytest.raises(CheckpointError, match="there are none"):
        CheckpointStore(tmp_path).latest()


def test_a_crash_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path):
    # A real crash: a process whose os.rename ends the process (os._exit) in the middle of save().
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2)
    code = (
        "import os, torch\n"
        "from mixtrain.checkpoint import CheckpointStore\n"
        "os.rename = lambda *a: os._exit(9)\n"
        f"CheckpointStore({str(tmp_path)!r}).save({{'w': torch.ones(3)}}, {{'global_step': 4}})\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert len(list(store.root.glob(".tmp-*"))) == 1  # the half-finished one
    _, manifest, _ = store.latest()
    assert manifest["global_step"] == 2
    _save(store, 6, 6)  # the next save clears the leftover
    assert not list(store.root.glob(".tmp-*"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_checkpoint_carrying_pickled_code_is_refused_and_never_run(tmp_path):
    store = CheckpointStore(tmp_path)
    path = _save(store, 2, 2)
    with open(path / STATE, "wb") as f:  # a forged state.pt, with a manifest that matches it
        pickle.dump({"model": _Payload()}, f)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][STATE] = {"sha256": _sha256(path / STATE), "bytes": (path / STATE).stat().st_size}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refused to load state\.pt"):
        CheckpointStore.read(path)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")
