import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from mixtrain import load_weights
from mixtrain.checkpoint import (
    MANIFEST_SHA256,
    STATE,
    CheckpointError,
    CheckpointStore,
    _manifest_digest,
    _sha256,
    atomic_save,
)


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
    manifest[MANIFEST_SHA256] = _manifest_digest(manifest)  # a forger recomputes the manifest's own hash too
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"refused to load state\.pt"):
        CheckpointStore.read(path)
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


# ---- issue 18, item 6: weights without pickle; item 5: malformed manifests fall back ------------------------
def test_final_weights_are_safetensors_and_load_weights_reads_both_formats(tmp_path):
    from safetensors.torch import load_file

    from mixtrain.checkpoint import save_weights

    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied weights share memory: written once each, loaded as equal tensors
    state = {"emb.weight": emb.weight, "head.weight": head.weight, "scale": torch.tensor(2.0, dtype=torch.bfloat16)}
    path = save_weights(state, tmp_path / "model.safetensors")
    assert path.read_bytes()[8:9] == b"{" and os.listdir(tmp_path) == ["model.safetensors"]
    plain = load_file(path)  # what anyone with safetensors (Hugging Face, no mixtrain) loads
    got = load_weights(path)
    for name, want in state.items():
        assert torch.equal(got[name], want) and torch.equal(plain[name], want) and got[name].dtype == want.dtype
    old = atomic_save({"w": torch.ones(2)}, tmp_path / "old" / "model.pt")  # written by an earlier mixtrain
    assert torch.equal(load_weights(old)["w"], torch.ones(2))
    assert torch.equal(load_weights(tmp_path / "old")["w"], torch.ones(2))  # a run folder: its final weights
    assert set(load_weights(tmp_path)) == set(state)
    with pytest.raises(ValueError, match="entry 'opt' is a object"):
        save_weights({"w": torch.ones(1), "opt": object()}, tmp_path / "bad.safetensors")


def test_a_checkpoints_model_is_a_safetensors_file_and_the_rest_keeps_torch_save(tmp_path):
    from safetensors.torch import load_file

    from mixtrain.checkpoint import MODEL

    store = CheckpointStore(tmp_path)
    model = {"w": torch.arange(3.0), "step_count": 7}  # a non-tensor entry (a module's extra state) too
    path = store.save({"model": model, "optimizer": {"state": {}, "lr": 0.1}}, {"global_step": 2, "epoch": 0})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 2 and set(manifest["files"]) == {MODEL, STATE}
    assert torch.equal(load_file(path / MODEL)["w"], torch.arange(3.0))
    raw = torch.load(path / STATE, weights_only=True)
    assert "w" not in raw["model"] and raw["optimizer"]["lr"] == 0.1
    state, _ = store.read(path)
    assert torch.equal(state["model"]["w"], torch.arange(3.0)) and state["model"]["step_count"] == 7


def test_a_checkpoint_of_the_earlier_format_still_loads(tmp_path):
    path = tmp_path / "checkpoints" / "step-000000002"
    path.mkdir(parents=True)
    torch.save({"model": {"w": torch.ones(3)}, "epoch": 0}, path / STATE)
    entry = {"sha256": _sha256(path / STATE), "bytes": (path / STATE).stat().st_size}
    (path / "manifest.json").write_text(json.dumps({"format": 1, "files": {STATE: entry}, "global_step": 2}))
    state, manifest, _ = CheckpointStore(tmp_path).latest()
    assert manifest["format"] == 1 and torch.equal(state["model"]["w"], torch.ones(3))


@pytest.mark.parametrize(
    "manifest",
    [
        [],  # not an object
        {"format": 2, "global_step": 4, "saved_seq": 2},  # no files
        {"format": 2, "files": {STATE: {"sha256": "x"}}, "global_step": 4, "saved_seq": 2},  # an entry without its size
        {"format": 2, "files": {STATE: "x"}, "global_step": 4, "saved_seq": 2},
        {
            "format": 2,
            "files": {"../../etc/passwd": {"sha256": "x", "bytes": 1}, STATE: {}},
            "global_step": 4,
            "saved_seq": 2,
        },
    ],
    ids=["list", "no-files", "no-bytes", "entry-not-object", "path-outside"],
)
def test_a_malformed_manifest_falls_back_to_the_previous_checkpoint(tmp_path, manifest):
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2)
    newest = _save(store, 4, 4)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    warnings = []
    state, good, _ = store.latest(warnings.append)
    assert good["global_step"] == 2 and torch.equal(state["model"]["w"], torch.full((3,), 2.0))
    assert len(warnings) == 1 and "malformed" in warnings[0] and "step-000000004" in warnings[0]


def test_resume_skips_a_checkpoint_whose_manifest_lacks_where_to_continue(tmp_path):
    from mixtrain.trainer import load_resume

    store = CheckpointStore(tmp_path)
    meta = {"epoch": 0, "step": 2, "shares": [4], "num_workers": 1, "workers": []}
    store.save({"model": {"w": torch.ones(3)}}, {**meta, "global_step": 2})
    store.save({"model": {"w": torch.zeros(3)}}, {"global_step": 4})  # the rest of its metadata is missing
    warnings = []
    _, manifest, path = load_resume(tmp_path, warnings.append)
    assert manifest["global_step"] == 2 and path.name == "step-000000002"
    assert "lacks epoch, step, shares, num_workers, workers" in warnings[0]


# ---- issue 33: prune never deletes the newest good checkpoint; a step saved again leaves no gap -------------
def _w(state):
    return state["model"]["w"][0].item()


@pytest.mark.parametrize("leftover", ["no-manifest", "truncated-manifest"])
def test_an_unreadable_folder_never_makes_prune_delete_the_newest_good_checkpoint(tmp_path, leftover):
    # A step-* folder whose manifest cannot be read (an earlier version's prune cut short by a second Ctrl-C)
    # sorts first for loading, which reports it; prune neither counts it as kept nor deletes it.
    store = CheckpointStore(tmp_path, keep=1)
    _save(store, 2, 2)
    broken = store.root / "step-000000003"
    broken.mkdir()
    (broken / STATE).write_bytes(b"half")
    if leftover == "truncated-manifest":
        (broken / "manifest.json").write_text('{"format": 2, "fi')
    newest = _save(store, 4, 4)
    assert newest.exists() and not (store.root / "step-000000002").exists() and broken.exists()
    warnings = []
    state, _, path = store.latest(warnings.append)
    assert path == newest and _w(state) == 4
    assert len(warnings) == 1 and "step-000000003: unreadable manifest" in warnings[0]
    assert store.prune(keep=1) == [] and newest.exists()


def test_a_full_disk_keeps_the_newest_good_checkpoint_beside_an_unreadable_one(tmp_path):
    from mixtrain.driver.checkpointing import save_making_room

    class Quiet:
        def log(self, line):
            self.line = line

        def write(self, kind, record):
            self.record = (kind, record)

    store = CheckpointStore(tmp_path, keep=3)
    _save(store, 2, 2)
    good = _save(store, 4, 4)
    (store.root / "step-000000005").mkdir()  # no manifest

    def full(state, meta):
        raise OSError(28, "No space left on device")

    store.save = full
    assert save_making_room(store, {}, {"global_step": 6}, Quiet(), Quiet(), good) is None
    assert good.exists() and not (store.root / "step-000000002").exists()
    assert CheckpointStore(tmp_path).latest()[2] == good


def test_a_prune_cut_short_leaves_no_half_deleted_checkpoint(tmp_path):
    # A real crash in the middle of deleting: rmtree has removed the manifest when the process ends.
    store = CheckpointStore(tmp_path, keep=2)
    _save(store, 2, 2)
    _save(store, 4, 4)
    code = (
        "import os, shutil\n"
        "from pathlib import Path\n"
        "from mixtrain.checkpoint import CheckpointStore\n"
        "def crash(path, *args, **kwargs):\n"
        "    (Path(path) / 'manifest.json').unlink()\n"
        "    os._exit(9)\n"
        "shutil.rmtree = crash\n"
        f"CheckpointStore({str(tmp_path)!r}).prune(1)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert [p.name for p in store.paths()] == ["step-000000004"]  # the rest is hidden (.tmp-*)
    warnings = []
    assert store.latest(warnings.append)[2].name == "step-000000004" and warnings == []
    _save(store, 6, 6)
    assert sorted(os.listdir(store.root)) == ["step-000000004", "step-000000006"]


def _resave_in_a_process_that_crashes(tmp_path, at):
    code = (
        "import os, torch\n"
        "from pathlib import Path\n"
        "from mixtrain.checkpoint import CheckpointStore\n"
        "real = os.rename\n"
        "def rename(src, dst):\n"
        f"    if {at!r} == 'rename-in' and Path(src).name.startswith('.tmp-'):\n"
        "        os._exit(9)\n"
        f"    if {at!r} == 'delete' and Path(dst).name.startswith('.tmp-del'):\n"
        "        os._exit(9)\n"
        "    real(src, dst)\n"
        "os.rename = rename\n"
        f"CheckpointStore({str(tmp_path)!r}).save({{'model': {{'w': torch.full((3,), 9.0)}}}}, {{'global_step': 4}})\n"
    )
    return subprocess.run([sys.executable, "-c", code]).returncode


@pytest.mark.parametrize(("at", "survivor"), [("rename-in", 4), ("delete", 9)])
def test_a_crash_while_the_same_step_is_saved_again_leaves_that_step_loadable(tmp_path, at, survivor):
    # Ctrl-C right after a resume (and every resume with --shard-optimizer) writes the same step again.
    store = CheckpointStore(tmp_path)
    _save(store, 2, 2)
    _save(store, 4, 4)
    assert _resave_in_a_process_that_crashes(tmp_path, at) == 9
    warnings = []
    state, manifest, _ = store.latest(warnings.append)
    assert manifest["global_step"] == 4 and _w(state) == survivor and warnings == []
    _save(store, 4, 5)  # the next save of that step finishes the job and clears what the crash left
    assert sorted(os.listdir(store.root)) == ["step-000000002", "step-000000004"]
    assert _w(store.latest()[0]) == 5


def test_a_failed_rename_puts_the_old_checkpoint_of_that_step_back(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    store = CheckpointStore(tmp_path)
    _save(store, 4, 4)
    real = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, "injected")
        real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        _save(store, 4, 5)
    monkeypatch.undo()
    assert os.listdir(store.root) == ["step-000000004"] and _w(store.latest()[0]) == 4


def test_a_checkpoint_link_is_skipped_and_never_followed_by_save_or_prune(tmp_path):
    # mixtrain never writes a link among its checkpoints: loading skips one (with a line), prune leaves it, and
    # a step saved again over one replaces the link, never what it points to.
    store = CheckpointStore(tmp_path / "run", keep=1)
    elsewhere = _save(CheckpointStore(tmp_path / "elsewhere"), 8, 8)  # a good checkpoint, outside this run
    (elsewhere / "keep.txt").write_text("not mixtrain's")
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    good = _save(store, 2, 2)
    (store.root / "step-000000008").symlink_to(elsewhere)
    (store.root / "step-000000009").symlink_to(elsewhere)
    (store.root / ".tmp-planted").symlink_to(elsewhere)  # as if left by a crash: cleared, the link only
    warnings = []
    assert store.latest(warnings.append)[2] == good and "step-000000009: a symbolic link" in warnings[0]
    assert store.prune(1) == [] and (store.root / "step-000000009").is_symlink()
    _save(store, 8, 80)  # the same step as the link
    assert not (store.root / "step-000000008").is_symlink() and _w(store.latest()[0]) == 80
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before
    assert sorted(os.listdir(store.root)) == ["step-000000008", "step-000000009"]


# ---- issue 33: the manifest's values are checked; a bad one falls back with a clear line ------------------
def _rewrite_manifest(path, **changes):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    manifest[MANIFEST_SHA256] = _manifest_digest(manifest)  # valid as a whole: the values themselves are wrong
    (path / "manifest.json").write_text(json.dumps(manifest))


_META = {"epoch": 0, "step": 2, "shares": [4], "num_workers": 1, "workers": [], "global_batch": 4, "num_samples": 16}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"step": 9999}, "step=9999, past the end of its epoch (4 steps of 4 in 16 samples)"),
        ({"step": -5}, "step=-5, not an integer >= 0"),
        ({"epoch": "1"}, "epoch='1', not an integer >= 0"),
        ({"epoch": True}, "epoch=True, not an integer >= 0"),
        ({"step": 1.0}, "step=1.0, not an integer"),
        ({"num_workers": 0}, "num_workers=0, not an integer >= 1"),
        ({"shares": [4, -1]}, "shares=[4, -1], not a list of integers >= 0"),
        ({"shares": "4"}, "shares='4', not a list"),
        ({"workers": [{"host": 1}]}, "workers=[{'host': 1}], not a list of objects of strings"),
        ({"run_id": 7}, "run_id=7, not a string"),
        ({"seed": -1}, "seed=-1, not an integer >= 0"),
        ({"global_batch": None}, "global_batch=None, not an integer >= 0"),
    ],
)
def test_a_manifest_value_of_the_wrong_type_or_range_falls_back_to_the_previous_checkpoint(tmp_path, change, says):
    from mixtrain.trainer import load_resume

    store = CheckpointStore(tmp_path)
    store.save({"model": {"w": torch.full((3,), 1.0)}}, {**_META, "step": 1, "global_step": 1})
    _rewrite_manifest(store.save({"model": {"w": torch.full((3,), 2.0)}}, {**_META, "global_step": 2}), **change)
    warnings = []
    state, manifest, _ = load_resume(tmp_path, warnings.append)
    assert manifest["global_step"] == 1 and _w(state) == 1
    assert len(warnings) == 1 and "step-000000002: its manifest has" in warnings[0] and says in warnings[0]
    assert "trying the previous one" in warnings[0]


def test_a_resume_with_no_usable_checkpoint_stops_with_one_clear_error(tmp_path):
    from mixtrain import Task, Trainer

    path = CheckpointStore(tmp_path).save({"model": {"w": torch.ones(3)}}, {**_META, "global_step": 2})
    _rewrite_manifest(path, epoch="1")
    model = torch.nn.Linear(3, 1)
    trainer = Trainer(
        lambda: Task(model=model, optimizer=torch.optim.SGD(model.parameters()), loss_fn=torch.nn.functional.mse_loss),
        (torch.zeros(16, 3), torch.zeros(16, 1)),
        global_batch=4,
    )
    for resume in (tmp_path, path):  # a run folder, and the checkpoint folder itself
        with pytest.raises(CheckpointError, match=r"epoch='1', not an integer >= 0"):
            trainer._load_resume(resume, 3, [])


def test_a_manifest_changed_after_it_was_written_fails_its_own_hash(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save({"model": {"w": torch.ones(3)}}, {**_META, "step": 1, "global_step": 1})
    newest = store.save({"model": {"w": torch.ones(3)}}, {**_META, "global_step": 2})
    text = (newest / "manifest.json").read_text()
    (newest / "manifest.json").write_text(text.replace('"step": 2', '"step": 3'))  # a bit flip, still valid
    warnings = []
    assert store.latest(warnings.append)[1]["global_step"] == 1
    assert "does not match its own SHA-256" in warnings[0]
