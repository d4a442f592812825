"""The door for users' code, without processes: Task checks, batches moved to a device, the per-sample
seeding rule, datasets read lazily, TokenWindows over a memory map, evaluation sums, clear errors."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch import nn

from mixtrain import Task
from mixtrain.data import Loader, TokenWindows, seed_sample
from mixtrain.data.sources import DatasetSource, TensorSource, describe, to_device
from mixtrain.worker import evaluation
from tests.conftest import REPO
from tests.datasets import Augmented, DictSamples, read_counts


def linear_task(**kwargs) -> Task:
    m = nn.Linear(4, 3)
    return Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), **kwargs)


def test_a_task_needs_a_loss_and_a_positive_clipping_norm():
    with pytest.raises(TypeError, match=r"Task needs loss_fn.*or compute_loss"):
        linear_task()
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match=r"Task.max_grad_norm=.*must be a number > 0, or None"):
            linear_task(loss_fn=nn.functional.cross_entropy, max_grad_norm=bad)


def test_compute_loss_must_return_a_scalar_tensor_and_the_message_says_how():
    x = torch.randn(6, 4)
    per_sample = linear_task(
        compute_loss=lambda m, b: nn.functional.cross_entropy(m(b), torch.zeros(6, dtype=torch.long), reduction="none")
    )
    with pytest.raises(
        TypeError, match=r"returned a tensor of shape \(6,\); it must return the MEAN loss.*loss.mean\(\)"
    ):
        per_sample.batch_loss(per_sample.model, x)
    not_tensor = linear_task(compute_loss=lambda m, b: 1.5)
    with pytest.raises(TypeError, match=r"Task\.compute_loss returned float"):
        not_tensor.batch_loss(not_tensor.model, x)
    mean = linear_task(compute_loss=lambda m, b: m(b).pow(2).mean())
    assert mean.batch_loss(mean.model, x).shape == ()


def test_batches_of_any_shape_move_to_the_device_and_unknown_leaves_are_named():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "ids": torch.ones(2, 3),
        "nested": [torch.zeros(1), (torch.ones(1), 3, "text", None)],
        "p": Pair(torch.ones(1), 2),
    }
    moved = to_device(batch, torch.device("cpu"))
    assert moved["nested"][1][1:] == (3, "text", None) and isinstance(moved["p"], Pair)
    with pytest.raises(
        TypeError, match=r"batch\['odd'\] holds a object, which cannot be moved to cpu: make the collate"
    ):
        to_device({"odd": object()}, torch.device("cpu"))


def test_seed_sample_sets_every_stream_from_seed_epoch_and_index():
    def draw():
        import random

        return (float(torch.rand(1)), float(np.random.rand()), random.random())

    seed_sample(7, 0, 3)
    a = draw()
    seed_sample(7, 0, 3)
    assert draw() == a
    for other in ((7, 1, 3), (7, 0, 4), (8, 0, 3)):
        seed_sample(*other)
        assert all(x != y for x, y in zip(draw(), a))


def test_describe_keeps_tensors_zero_copy_and_datasets_lazy():
    x, y = torch.randn(10, 4), torch.arange(10)
    assert isinstance(describe((x, y), "train_data"), tuple)
    assert isinstance(describe(torch.utils.data.TensorDataset(x, y), "train_data"), tuple)
    assert isinstance(describe(DictSamples(x, y), "train_data"), Loader)
    built = describe(lambda: DictSamples(x, y), "train_data")
    assert isinstance(built, Loader) and built.built_on_workers
    with pytest.raises(TypeError, match="train_data of type str is not supported"):
        describe("images/", "train_data")
    with pytest.raises(ValueError, match=r"Loader.num_workers=-1: must be an integer >= 0"):
        Loader(dataset=DictSamples(x, y), num_workers=-1)


def test_a_dataset_source_reads_only_what_it_is_asked_and_restores_the_callers_random_streams():
    x, y = torch.randn(50, 4), torch.arange(50) % 3
    source = DatasetSource(Loader(dataset=Augmented(x, y), num_workers=0), seed=7, pin_memory=False)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    chunks = [np.array([5, 9]), np.array([1])]
    first = list(source.batches(0, chunks))
    assert torch.equal(torch.get_rng_state(), before)  # dropout streams in this process are untouched
    again = list(source.batches(0, chunks))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))  # the same views for the same epoch
    later = list(source.batches(1, chunks))
    assert not torch.equal(first[0][0], later[0][0])  # a fresh view every epoch
    assert [len(b[1]) for b in first] == [2, 1] and torch.equal(first[0][1], y[[5, 9]])


def test_a_batch_is_seeded_sample_by_sample_without_torch_manual_seed_and_its_streams_saved_once(monkeypatch):
    # issue 45: torch.manual_seed also seeds every CUDA, XPU and MTIA device, and before CUDA starts it formats a
    # stack trace per device for each call: 2-5 ms a sample, five times the newcomer's step. Saving numpy's state
    # around each sample cost about 0.2 ms more. Both are counted here (a DataLoader's batch: one __getitems__).
    calls = {"manual_seed": 0, "np_get_state": 0}
    for name, module, key in (("manual_seed", torch, "manual_seed"), ("get_state", np.random, "np_get_state")):
        real = getattr(module, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    x, y = torch.randn(50, 4), torch.arange(50) % 3
    source = DatasetSource(Loader(dataset=Augmented(x, y), num_workers=0), seed=7, pin_memory=False)
    batches = list(source.batches(0, [np.arange(16), np.arange(16, 32)]))
    assert calls == {"manual_seed": 0, "np_get_state": 2}, calls
    for i in (3, 20):  # each sample's view is still the one seed_sample gives it
        seed_sample(7, 0, i)
        want = Augmented(x, y)[i][0]
        assert torch.equal(batches[i // 16][0][i % 16], want)


def test_the_first_samples_are_read_once_however_often_the_checks_and_the_probe_ask(tmp_path):
    # the shape check (1 sample), the numerics check (8) and the probe (32, its trials up to 100) share one read
    # of the first 32 samples in epoch 0's views; a smaller dataset is read whole and repeated
    x, y = torch.randn(50, 4), torch.arange(50) % 3
    source = DatasetSource(Loader(dataset=Augmented(x, y, str(tmp_path)), num_workers=0), seed=7, pin_memory=False)
    source.first(1).batch(1)
    source.first(8).batch(8)
    held = source.first(32)
    assert read_counts(str(tmp_path)) == dict.fromkeys(range(32), 1) and held.read_s > 0
    big = held.batch(100)
    assert len(big[1]) == 100 and torch.equal(big[0][32], big[0][0])  # repeated past the 32 read
    assert torch.equal(big[0][:2], source.read(0, np.arange(2))[0])  # epoch 0's views, as a fresh read sees them
    source.forget_first()
    assert len(source.first(60).samples) == 50  # the whole dataset, read again only after forget_first
    assert sum(read_counts(str(tmp_path)).values()) == 32 + 2 + 50
    rows = TensorSource((np.arange(10.0).reshape(5, 2), np.arange(5)))
    assert rows.first(3).batch(4)[1].tolist() == [0, 1, 2, 0]


def test_samples_of_different_structure_get_a_clear_error():
    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(i + 1), i

    source = DatasetSource(Loader(dataset=Ragged()), seed=0, pin_memory=False)
    with pytest.raises(ValueError, match=r"could not make a batch of 2 samples.*same structure.*collate_fn"):
        source.read(0, np.array([0, 1]))


def test_evaluation_sums_add_up_and_a_metric_must_be_a_pair():
    task = linear_task(
        compute_loss=lambda m, b: m(b["x"]).pow(2).mean(), metrics=lambda m, b: {"n": (len(b["x"]), 2.0)}
    )
    parts = [dict(evaluation.batch_sums(task, {"x": torch.ones(k, 4)}, k)) for k in (3, 1)]
    out = evaluation.summarize(parts)
    assert out["samples"] == 4 and out["n"] == 4 / 4 and "accuracy" not in out
    bad = linear_task(compute_loss=lambda m, b: m(b).mean(), metrics=lambda m, b: {"acc": 0.5})
    with pytest.raises(TypeError, match=r"Task.metrics returned 'acc': 0.5; each metric must be a \(sum, count\) pair"):
        dict(evaluation.batch_sums(bad, torch.ones(2, 4), 2))


def test_token_windows_read_shifted_windows_and_pickle_without_the_data(tmp_path):
    path = tmp_path / "tokens.u16"
    np.arange(1000, dtype=np.uint16).tofile(path)
    windows = TokenWindows(path, 64)
    assert len(windows) == (1000 - 1) // 64
    x, y = windows[2]
    assert x.dtype == torch.int64 and torch.equal(x, torch.arange(128, 192)) and torch.equal(y, x + 1)
    assert len(pickle.dumps(windows)) < 1000  # the path, not the tokens
    with pytest.raises(ValueError, match="too few for one window"):
        TokenWindows(path, 5000)
    with pytest.raises(FileNotFoundError, match="no token file"):
        TokenWindows(tmp_path / "missing.u16", 8)


def test_a_worker_reading_a_2gb_token_file_stays_far_below_its_size(tmp_path):
    """A sparse 2 GB file (1G uint16 tokens): a process that reads 2,000 windows spread over all of it,
    through the same DatasetSource a worker uses, peaks far below 2 GB of resident memory."""
    path = tmp_path / "big.u16"
    with open(path, "wb") as f:
        f.truncate(2 * 2**30)
    script = textwrap.dedent(
        f"""
        import numpy as np
        from mixtrain.data import Loader, TokenWindows
        from mixtrain.data.sources import DatasetSource
        def peak_mb():  # VmHWM: this process's own high-water mark (ru_maxrss would count the forking parent's)
            line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
            return int(line.split()[1]) // 1024
        source = DatasetSource(Loader(dataset=TokenWindows({str(path)!r}, 256), num_workers=0), 0, False)
        before = peak_mb()
        picks = np.linspace(0, len(source) - 1, 2000).astype(np.int64)
        total = sum(int(b[0].shape[0]) for b in source.batches(0, np.array_split(picks, 40)))
        assert total == 2000, total
        print(before, peak_mb())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True)
    before_mb, peak_mb = map(int, out.stdout.split()[-2:])
    assert peak_mb < 600, f"peak RSS {peak_mb} MB for a 2048 MB token file"
    # what the reads added: the windows held (2,000 x 257 tokens, about 1 MB) and buffers, not the file's pages
    assert peak_mb - before_mb < 64, f"reading 2,000 windows added {peak_mb - before_mb} MB"


def test_a_tensor_source_keeps_the_zero_copy_path_and_narrows_float64_for_mps():
    arrays = (np.zeros((4, 2), dtype=np.float64), np.arange(4))
    assert TensorSource(arrays).fields[0].dtype == torch.float64
    assert TensorSource(arrays, supports_float64=False).fields[0].dtype == torch.float32
    _, y = TensorSource(arrays).read(0, np.array([3, 1]))
    assert y.tolist() == [3, 1]


def test_loss_fn_with_samples_that_are_not_input_target_tuples_says_to_give_compute_loss():
    task = linear_task(loss_fn=nn.functional.cross_entropy)
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    assert task.batch_problem((x, y)) is None and task.batch_problem([x, y]) is None
    for batch, what in (
        ({"input_ids": x, "labels": y}, "dicts (keys 'input_ids', 'labels')"),
        ((x,), "tuples of 1 field, with no target"),
        (x, "a Tensor, not (inputs..., target) tuples"),
    ):
        problem = task.batch_problem(batch)
        assert problem is not None and what in problem and "compute_loss=lambda m, b: m(**b).loss" in problem
        with pytest.raises(ValueError, match="Give compute_loss instead"):
            task.batch_loss(task.model, batch)  # held-out batches too: one line, not an error inside the model
    assert linear_task(compute_loss=lambda m, b: m(b["x"]).sum()).batch_problem({"x": x}) is None
