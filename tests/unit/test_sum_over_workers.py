"""mixtrain.train.sum_over_workers outside a multi-worker run: one worker's values come back as they are (a loop
run alone, or with one worker), and bad input names the field and the fix (issue 45 item 3; the sum over real
workers is tests/ray/test_loops.py)."""

from __future__ import annotations

import pytest
import torch

import mixtrain.train
from mixtrain.errors import InputTypeError
from mixtrain.train import _session
from tests.unit.test_loop_session import _session as one_worker_session


def test_without_a_process_group_the_values_come_back_as_numbers():
    totals = mixtrain.train.sum_over_workers({"correct": torch.tensor(7), "count": 9, "loss": 1.5})
    assert totals == {"correct": 7.0, "count": 9.0, "loss": 1.5}


def test_with_one_worker_the_values_come_back_without_a_collective():
    _session.start(one_worker_session())
    try:
        assert mixtrain.train.sum_over_workers({"count": 3}) == {"count": 3.0}
    finally:
        _session.end()


@pytest.mark.parametrize(
    ("values", "named"),
    [({}, "values={}"), ([1, 2], "values=[1, 2]"), ({"x": "3"}, "'x' is '3'"), ({"x": torch.ones(2)}, "'x' is")],
)
def test_what_is_not_names_to_numbers_is_refused_naming_it(values, named):
    with pytest.raises(InputTypeError, match="sum_over_workers") as err:
        mixtrain.train.sum_over_workers(values)
    assert named in str(err.value)


@pytest.mark.parametrize(("shuffle", "ordered"), [(True, False), (False, True)])
def test_a_torchrun_loaders_distributed_sampler_keeps_its_own_shuffle_under_prepare(shuffle, ordered):
    # DataLoader(shuffle=False, sampler=DistributedSampler(data)) shuffles under torchrun: a port that wraps the
    # loader as it is must shuffle too, and one whose sampler says shuffle=False must not
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from mixtrain.train._prepare import PreparedLoader

    data = TensorDataset(torch.arange(40))
    loader = DataLoader(data, batch_size=8, shuffle=False, sampler=DistributedSampler(data, 1, 0, shuffle=shuffle))
    session = one_worker_session()
    session.batch_workers = 1
    seen = torch.cat([batch[0] for batch in PreparedLoader(loader, session)]).tolist()
    assert sorted(seen) == list(range(40)) and (seen == list(range(40))) == ordered
