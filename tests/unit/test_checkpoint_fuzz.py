"""A run folder's checkpoints are input: whatever their manifest.json holds (truncated JSON, wrong types,
out-of-range numbers, unknown keys, links), a resume loads a good checkpoint or stops with one clear
CheckpointError/ValueError, and saving and pruning never delete or overwrite anything outside the checkpoints
folder. Property-based (hypothesis) over a real run folder, plus the inputs that could hang a reader."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixtrain import RunConfig, Task, Trainer
from mixtrain.checkpoint import MANIFEST, MANIFEST_SHA256, CheckpointError, CheckpointMeta, CheckpointStore
from mixtrain.checkpoint import _manifest_digest as digest

NEWEST = "step-000000004"
KEYS = [
    "format",
    "files",
    "epoch",
    "step",
    "global_step",
    "shares",
    "num_workers",
    "workers",
    "run_id",
    "global_batch",
    "num_samples",
    "seed",
    "data_fingerprint",
    "saved_seq",
    MANIFEST_SHA256,
]


def _task() -> Task:
    model = torch.nn.Linear(2, 1)
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters()), loss_fn=torch.nn.functional.mse_loss)


def _trainer() -> Trainer:
    return Trainer(_task, (torch.zeros(16, 2), torch.zeros(16, 1)), global_batch=4, run=RunConfig(run_dir="unused"))


def _meta(step: int) -> dict:
    return {"epoch": 0, "step": step, "global_step": step, "shares": [4], "num_workers": 1, "workers": []}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """base/run/checkpoints/{step-2, step-4}, and what must survive: base/run/notes.txt (in the run folder,
    outside its checkpoints) and base/elsewhere/ (a copy of a good checkpoint and a file, outside the run)."""
    base = tmp_path_factory.mktemp("template")
    store = CheckpointStore(base / "run")
    fields = {"global_batch": 4, "num_samples": 16, "seed": 0}
    store.save({"model": {"w": torch.full((2,), 2.0)}}, {**_meta(2), **fields})
    store.save({"model": {"w": torch.full((2,), 4.0)}}, {**_meta(4), **fields})
    (base / "run" / "notes.txt").write_text("the user's")
    shutil.copytree(store.root / NEWEST, base / "elsewhere" / NEWEST)
    (base / "elsewhere" / "keep.txt").write_text("not mixtrain's")
    return base


def _snapshot(base: Path) -> dict[str, bytes]:
    """Every file outside the checkpoints folder, by path."""
    files = {p: p.read_bytes() for p in [base / "run" / "notes.txt", *(base / "elsewhere").rglob("*")] if p.is_file()}
    return {str(p.relative_to(base)): data for p, data in files.items()}


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
TARGETS = ["good copy", "a file", "nowhere"]
KEY = st.sampled_from(KEYS) | st.text(max_size=10)

MUTATIONS = st.one_of(
    st.tuples(st.just("set"), KEY, JSON, st.booleans()),  # a value of any type; the manifest's own hash redone or not
    st.tuples(st.just("set"), st.sampled_from(KEYS[2:13]), st.integers(-(2**66), 2**66), st.just(True)),
    st.tuples(st.just("drop"), st.sampled_from(KEYS), st.just(None), st.booleans()),
    st.tuples(st.just("truncate"), st.integers(0, 2000), st.just(None), st.just(False)),
    st.tuples(st.just("bytes"), st.binary(max_size=64), st.just(None), st.just(False)),
    st.tuples(
        st.just("link-manifest"), st.sampled_from(["good copy", "a file", "nowhere"]), st.just(None), st.just(False)
    ),
    st.tuples(
        st.just("link-folder"), st.sampled_from(["good copy", "a file", "nowhere"]), st.just(None), st.just(False)
    ),
)


def _mutate(base: Path, mutation: tuple) -> None:
    kind, what, value, rehash = mutation
    folder = base / "run" / "checkpoints" / NEWEST
    target = {
        "good copy": base / "elsewhere" / NEWEST,
        "a file": base / "elsewhere" / "keep.txt",
        "nowhere": base / "gone",
    }.get(what)
    if kind == "link-folder":
        shutil.rmtree(folder)
        folder.symlink_to(target)
        return
    if kind == "link-manifest":
        (folder / MANIFEST).unlink()
        (folder / MANIFEST).symlink_to(target / MANIFEST if what == "good copy" else target)
        return
    text = (folder / MANIFEST).read_text()
    if kind == "truncate":
        (folder / MANIFEST).write_text(text[: what % len(text)])
        return
    if kind == "bytes":
        (folder / MANIFEST).write_bytes(what)
        return
    manifest = json.loads(text)
    if kind == "set":
        manifest[what] = value
    else:
        manifest.pop(what, None)
    if rehash:
        manifest[MANIFEST_SHA256] = digest(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=MUTATIONS)
def test_any_manifest_resumes_from_a_good_checkpoint_or_stops_clearly_and_nothing_outside_is_touched(
    template, mutation
):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        shutil.copytree(template, base, symlinks=True)
        _mutate(base, mutation)
        before = _snapshot(base)
        warnings: list[str] = []
        try:
            state, manifest, path = _trainer()._load_resume(base / "run", 5, warnings)
        except (CheckpointError, ValueError) as exc:
            assert str(exc) and "\n" not in str(exc)
        else:  # a good one: the fuzzed newest if it still is one, else the one before (and a line saying why)
            CheckpointMeta.from_manifest(manifest)  # it checks out
            assert path.parent == base / "run" / "checkpoints" and not path.is_symlink()
            assert state["model"]["w"][0].item() == int(path.name[len("step-") :])
            assert path.name == NEWEST or len(warnings) == 1 or mutation[1] == "saved_seq"  # 0: older than step 2
        store = CheckpointStore(base / "run", keep=1)
        new = store.save({"model": {"w": torch.full((2,), 6.0)}}, {**_meta(6), "global_batch": 4, "num_samples": 16})
        store.prune(1)
        assert new.exists() and store.latest()[2] == new
        assert _snapshot(base) == before
        for name in os.listdir(store.root):  # what prune left: the new one, and what it could not read (a link)
            assert name == new.name or _unreadable(store.root / name), name


def _unreadable(path: Path) -> bool:
    try:
        CheckpointStore.verify(path)
    except CheckpointError:
        return True
    return path.is_symlink()


def _reads_within(seconds: float, call) -> BaseException | None:
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else TimeoutError(f"still reading after {seconds} s")


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "deeply nested", "huge"])
def test_a_manifest_that_could_hang_or_exhaust_a_reader_is_skipped(template, tmp_path, kind):
    base = tmp_path / "base"
    shutil.copytree(template, base, symlinks=True)
    manifest = base / "run" / "checkpoints" / NEWEST / MANIFEST
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "link to /dev/zero":
        manifest.symlink_to("/dev/zero")
    elif kind == "deeply nested":
        manifest.write_text("[" * 200_000)
    else:
        manifest.write_text(json.dumps({"pad": "x" * (2 << 20)}))
    warnings: list[str] = []
    error = _reads_within(10, lambda: CheckpointStore(base / "run").latest(warnings.append))
    if kind == "fifo" and isinstance(error, TimeoutError):  # let the blocked reader go (the old code's failure)
        os.close(os.open(manifest, os.O_WRONLY | os.O_NONBLOCK))
    assert error is None, error
    assert len(warnings) == 1 and f"{NEWEST}: unreadable manifest" in warnings[0]
