"""A loop run's checkpoints are kept by the store the `Task` path's are (_checkpoint_folders): a manifest with its own
SHA-256, names only inside the folder, no link followed, no pipe read, a bounded manifest, and pruning that keeps the
newest readable. A bad checkpoint is skipped within seconds and the previous good one is used."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from mixtrain._checkpoint_folders import MANIFEST_SHA256, _manifest_digest
from mixtrain.train._store import MANIFEST, LoopCheckpoints
from tests.unit.test_run_files import within

FILES = {"model.pt": b"weights", "extra/optimizer.pt": b"adam"}


def _store(tmp_path: Path, keep: int = 3) -> LoopCheckpoints:
    return LoopCheckpoints(tmp_path / "run", keep)


def _save_two(tmp_path: Path) -> tuple[LoopCheckpoints, Path, Path]:
    store = _store(tmp_path)
    good = store.save({**FILES, "model.pt": b"older"}, {"report": 1, "rank": 0, "metrics": {"loss": 1.0}})
    newest = store.save(FILES, {"report": 2, "rank": 0, "metrics": {"loss": 0.5}})
    return store, good, newest


def test_a_checkpoint_is_the_users_files_in_their_folder_and_a_hashed_private_manifest(tmp_path):
    store, _, newest = _save_two(tmp_path)
    assert newest.name == "checkpoint-000002" and (newest / "extra" / "optimizer.pt").read_bytes() == b"adam"
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest[MANIFEST_SHA256] == _manifest_digest(manifest) and manifest["report"] == 2
    assert stat.S_IMODE(os.stat(newest / "model.pt").st_mode) == 0o600
    assert store.latest()[:2] == (newest, FILES)


def _damage_newest(newest: Path, plant: str, outside: Path) -> None:
    if plant == "fifo":
        (newest / "model.pt").unlink()
        os.mkfifo(newest / "model.pt")
    elif plant == "link":  # to a file outside holding the very bytes the manifest names
        outside.write_bytes(FILES["model.pt"])
        (newest / "model.pt").unlink()
        (newest / "model.pt").symlink_to(outside)
    elif plant == "folder link":
        (outside / "extra").mkdir(parents=True)
        (outside / "extra" / "optimizer.pt").write_bytes(b"adam")
        os.rename(newest / "extra", newest / "gone")
        (newest / "extra").symlink_to(outside / "extra")
    elif plant == "2 MB manifest":
        manifest = json.loads((newest / MANIFEST).read_text())
        (newest / MANIFEST).write_text(json.dumps({**manifest, "pad": "x" * (2 << 20)}))
    elif plant == "fifo manifest":
        (newest / MANIFEST).unlink()
        os.mkfifo(newest / MANIFEST)
    elif plant == "edited manifest":
        manifest = json.loads((newest / MANIFEST).read_text())
        (newest / MANIFEST).write_text(json.dumps({**manifest, "report": 7}))


@pytest.mark.parametrize("plant", ["fifo", "link", "folder link", "2 MB manifest", "fifo manifest", "edited manifest"])
def test_a_bad_newest_checkpoint_is_skipped_within_seconds_and_the_previous_good_one_is_used(tmp_path, plant):
    store, good, newest = _save_two(tmp_path)
    _damage_newest(newest, plant, tmp_path / "outside")
    path, files, _ = within(store.latest)
    assert path == good and files["model.pt"] == b"older"


@pytest.mark.parametrize("name", ["../x", "/x", "a/../../x"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, name):
    store, good, newest = _save_two(tmp_path)
    target = (newest / name) if not name.startswith("/") else Path(name)
    data = b"outside"
    if not name.startswith("/"):
        target.resolve().parent.mkdir(parents=True, exist_ok=True)
        target.resolve().write_bytes(data)
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["files"] = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    manifest[MANIFEST_SHA256] = _manifest_digest(manifest)  # a forger can recompute the hash; the name is refused
    (newest / MANIFEST).write_text(json.dumps(manifest))
    path, files, _ = within(store.latest)
    assert path == good and all(".." not in n and not n.startswith("/") for n in files)


def test_a_loop_cannot_save_a_file_outside_the_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a name inside"):
        _store(tmp_path).save({"../escape": b"x"}, {"report": 1})
    assert not (tmp_path / "run" / "checkpoints" / "escape").exists()


def test_pruning_keeps_the_newest_readable_and_leaves_what_it_cannot_read(tmp_path):
    store = _store(tmp_path, keep=1)
    good = store.save(FILES, {"report": 1})
    planted = store.root / "checkpoint-000009"  # a newer name, but nothing mixtrain can read
    planted.mkdir()
    (planted / "notes.txt").write_text("keep me")
    newest = store.save(FILES, {"report": 2})
    assert newest.name == "checkpoint-000010" and not good.exists()
    assert (planted / "notes.txt").read_text() == "keep me"  # not deleted, and it did not take newest's place
    assert store.latest()[:2] == (newest, FILES)


def test_a_loop_checkpoint_from_before_the_shared_store_still_loads(tmp_path):
    old = tmp_path / "run" / "checkpoints" / "checkpoint-000001"
    old.mkdir(parents=True)
    (old / "model.pt").write_bytes(b"weights")
    entry = {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}
    (old / MANIFEST).write_text(json.dumps({"files": {"model.pt": entry}, "report": 1, "rank": 0, "metrics": {}}))
    store = _store(tmp_path)
    assert store.latest()[:2] == (old, {"model.pt": b"weights"})
    assert store.save(FILES, {"report": 2}).name == "checkpoint-000002"


@pytest.mark.parametrize(
    ("recorded", "read"),
    [([20, 8], [20, 8]), (None, []), ([20, "x"], []), ([0], []), ([True], []), ({"a": 1}, []), ([1] * 1001, [])],
)
def test_a_checkpoint_records_the_runs_global_batches_and_a_malformed_record_reads_as_none(tmp_path, recorded, read):
    # A resume keeps each prepared loader's global batch from the checkpoint (issue 45); what the manifest says is
    # taken only as a short list of positive integers, else the resumed loop's loaders set them again.
    store = _store(tmp_path)
    meta = {"report": 1, "rank": 0, "metrics": {}, **({"global_batches": recorded} if recorded is not None else {})}
    store.save(FILES, meta)
    assert store.latest()[2] == read


def test_the_sink_leaves_out_the_worker_it_stopped_the_loop_for_even_if_a_later_look_withdraws_it(tmp_path):
    from mixtrain.train._sink import ReportSink

    sink = ReportSink(str(tmp_path), keep=2, global_batches=[20])
    named = {"rank": 1, "reason": "the job is 2.0x faster without it"}
    sink.event("plan", {"shares": [16, 4], "leave_out": named})
    assert sink.report(1, (0, 1), {}, FILES) is True  # the first rank's checkpoint is kept: every worker stops
    sink.event("plan", {"shares": [10, 10], "leave_out": None})  # a later look withdraws it
    assert sink.report(0, (0, 1), {"loss": 1.0}, None) is True and sink.leaving() == named
    manifest = json.loads((Path(sink.last_checkpoint) / MANIFEST).read_text())
    assert manifest["global_batches"] == [20]
    sink.clear_leave_out()
    assert sink.leaving() is None and sink.report(0, (1, 1), {}, FILES) is False
