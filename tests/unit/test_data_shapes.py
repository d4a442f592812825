"""Data as users hold it: a DataLoader is taken over (with a note), a stream is refused with the map-style fix."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from mixtrain.data import Loader, steps_per_epoch
from mixtrain.data.sources import describe
from mixtrain.errors import InputTypeError

X, Y = torch.randn(20, 3), torch.randint(0, 2, (20,))


class Items(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"x": X[i], "y": Y[i]}


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(X, Y)


def _collate(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "y": torch.stack([s["y"] for s in samples])}


def test_a_data_loader_is_taken_over_with_a_note():
    with pytest.warns(UserWarning, match=r"batch_size \(8\) and shuffle/sampler are not"):
        arrays = describe(DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True), "train_data")
    assert not isinstance(arrays, Loader)  # a TensorDataset keeps the zero-copy path
    with pytest.warns(UserWarning):
        spec = describe(DataLoader(Items(), batch_size=4, collate_fn=_collate, num_workers=1), "train_data")
    assert isinstance(spec, Loader) and spec.collate_fn is _collate and spec.num_workers == 1
    assert isinstance(spec.dataset, Items)


@pytest.mark.parametrize("data", [Stream(), DataLoader(Stream(), batch_size=4), iter([(X[0], Y[0])])])
def test_a_stream_is_refused_with_the_map_style_fix(data):
    with pytest.raises(InputTypeError, match=r"map-style Dataset .*streaming=True"):
        describe(data, "train_data")


def test_a_schedules_total_is_epochs_times_steps_per_epoch():
    assert steps_per_epoch(1000, 50) == 20 and steps_per_epoch(1001, 50) == 21  # the last step may be short


def test_every_name_the_plain_pytorch_table_uses_exists():
    """docs/your-own-code.md maps a plain loop's pieces to mixtrain's: each name it gives must be real."""
    import dataclasses
    import inspect

    import mixtrain
    from tests.conftest import REPO

    text = (REPO / "docs" / "your-own-code.md").read_text()
    table = text[text.index("| in your script | in mixtrain |") : text.index("A learning-rate schedule is")]
    task_fields = {f.name for f in dataclasses.fields(mixtrain.Task)}
    assert {"max_grad_norm", "scheduler", "metrics"} <= task_fields and all(
        f"{name}=" in table for name in ("max_grad_norm", "scheduler", "metrics")
    )
    assert "seed" in {f.name for f in dataclasses.fields(mixtrain.RunConfig)} and "RunConfig(seed=0)" in table
    trainer_args = inspect.signature(mixtrain.Trainer).parameters
    assert {"eval_data", "global_batch"} <= set(trainer_args) and "eval_data=" in table
    assert "model_path" in {f.name for f in dataclasses.fields(mixtrain.Result)} and "Result.model_path" in table
