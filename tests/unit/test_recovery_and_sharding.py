"""Pure parts of recovery without a state copy and of the sharded optimizer: whose state survivors continue
from, the parameter runs each rank's optimizer slice covers, the zero-copy state packing, partial rounds."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from mixtrain.comm.state_transfer import Packed, pack, unpack
from mixtrain.comm.zero import split_runs
from mixtrain.config import ScalingConfig
from mixtrain.policies.decisions import recovery_source
from mixtrain.records.messages import RoundPlan, WorkerReport
from mixtrain.records.rounds import summarize_round


def test_survivors_continue_from_the_most_advanced_one_and_those_behind_take_its_state():
    assert recovery_source({0: 3, 2: 4, 3: 4}) == (2, [0])
    assert recovery_source({1: 2, 2: 2}) == (1, [])  # all equal: nobody needs a copy
    assert recovery_source({0: 0, 1: 0}) == (0, [])  # a redone round (parameter servers)


@pytest.mark.parametrize(
    "sizes,weights",
    [([10] * 12, [1, 1, 1]), ([100, 5, 5, 50, 50, 1, 200], [3, 1, 2]), ([7, 3, 9, 1], [1, 0, 1]), ([4], [1, 1, 1])],
)
def test_optimizer_runs_cover_every_parameter_once_in_order_sized_by_weight(sizes, weights):
    runs = split_runs(sizes, weights)
    assert len(runs) == len(weights)
    assert runs[0][0] == 0 and runs[-1][1] == len(sizes)
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in itertools.pairwise(runs))
    for (lo, hi), w in zip(runs, weights):
        if w == 0:
            assert lo == hi  # a rank with no weight owns nothing
    if sizes == [10] * 12:
        assert [hi - lo for lo, hi in runs] == [4, 4, 4]


def test_unequal_weights_give_proportional_runs():
    sizes = [1] * 600
    runs = split_runs(sizes, [3, 1, 2])
    assert [hi - lo for lo, hi in runs] == [300, 100, 200]


def test_bad_shard_weights_are_refused_with_the_field_and_the_fix():
    with pytest.raises(ValueError, match="weights"):
        split_runs([1, 2], [0, 0])
    with pytest.raises(ValueError, match=r"ScalingConfig.shard_slices=\[1, 2\].*one\s+relative size"):
        ScalingConfig(num_workers=3, shard="full", shard_slices=[1, 2])
    with pytest.raises(ValueError, match=r"ScalingConfig.shard='zero3'.*optimizer, gradients, full"):
        ScalingConfig(num_workers=2, shard="zero3")
    ScalingConfig(num_workers=2, shard="gradients", shard_slices=[1, 2])  # fine


def test_shard_optimizer_still_works_and_says_it_is_now_shard_optimizer():
    with pytest.warns(DeprecationWarning, match="shard='optimizer'"):
        old = ScalingConfig(num_workers=2, shard_optimizer=[1, 2])
    assert (old.shard, list(old.shard_slices or []), old.shard_optimizer) == ("optimizer", [1, 2], False)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="give shard alone"):
        ScalingConfig(num_workers=2, shard_optimizer=True, shard="full")


def test_packed_state_round_trips_every_dtype_and_pickles_without_the_tensor_copy():
    state = {
        "model": {"w": torch.randn(3, 4), "b16": torch.randn(5).to(torch.bfloat16), "n": torch.tensor(7)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3).t()}}, "lr": 0.1},
        "nested": [torch.arange(4), (1, "x")],
    }
    packed = pack(state)
    assert isinstance(packed["model"]["w"], Packed) and packed["model"]["b16"].dtype == "bfloat16"
    back = unpack(pickle.loads(pickle.dumps(packed, protocol=5)), copy=True)
    for got, want in ((back["model"]["w"], state["model"]["w"]), (back["model"]["b16"], state["model"]["b16"])):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["nested"][1] == (1, "x") and back["optimizer"]["lr"] == 0.1
    view = unpack(packed)["model"]["w"]
    assert view.data_ptr() == state["model"]["w"].data_ptr()  # no copy unless asked


def test_a_round_cut_short_is_recorded_with_the_steps_that_stand():
    plan = RoundPlan(epoch=0, first_step=6, num_steps=4, shares=(8, 8, 8), global_batch=24, drift_tolerance=1e-6)
    ahead = WorkerReport(rank=0, samples=24, compute_s=[0.1, 0.1, 0.2], comm_s=[0.0] * 3, losses=[1.0, 0.9])
    behind = WorkerReport(rank=2, samples=16, compute_s=[0.2, 0.1], comm_s=[0.0] * 2, losses=[1.0])
    record = summarize_round(plan, [behind, ahead], wall_s=1.0, partial=(2, 48))
    assert record.partial and record.num_steps == 2 and record.samples == 48
    assert record.loss == pytest.approx(0.95) and record.last_loss == 0.9
    assert len(record.workers) == 2 and record.workers[1].wait_s == pytest.approx(0.0)


def test_offload_without_sliced_state_is_refused_with_the_fix():
    from mixtrain.config import StrategyConfig, check_together

    with pytest.raises(ValueError, match=r"offload='optimizer' with shard='none'.*give shard='optimizer'"):
        check_together(ScalingConfig(num_workers=2, offload="optimizer"), StrategyConfig())
    check_together(ScalingConfig(num_workers=1, shard="optimizer", offload="optimizer"), StrategyConfig())


def test_each_groups_memory_sizes_the_slices_and_a_bad_or_partial_one_is_refused():
    from types import SimpleNamespace

    from mixtrain import DeviceGroup
    from mixtrain.group.group_ops import GroupOps

    groups = [DeviceGroup(device="cpu", num_workers=2, memory="1.5GB"), DeviceGroup(device="cpu", memory=2**30)]
    scaling = ScalingConfig(groups=groups, shard="full")
    assert scaling.memory_caps() == [int(1.5 * 2**30)] * 2 + [2**30]
    members = [SimpleNamespace(spec=SimpleNamespace(rank=r)) for r in (2, 0)]  # rank 1 left out, the rest renumbered
    ops = GroupOps.__new__(GroupOps)
    ops.group = SimpleNamespace(scaling=scaling, members=members)
    assert ops._shard_weights() == (float(2**30), float(1.5 * 2**30))
    ops.group.scaling = ScalingConfig(groups=groups, shard="full", shard_slices=[1, 2, 3])  # the user's sizes first
    assert ops._shard_weights() == (3.0, 1.0)
    with pytest.raises(ValueError, match=r"DeviceGroup.memory='1.5XB'.*e\.g\. 12GB"):
        DeviceGroup(memory="1.5XB")
    with pytest.raises(ValueError, match="given for some groups only"):
        ScalingConfig(groups=[DeviceGroup(memory="1GB"), DeviceGroup()])
