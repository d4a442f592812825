"""Every ScalingConfig field a training loop takes is honoured by the loop's run or refused by name (issue 45: fields
such as numerics_check and max_micro_batch were taken and did nothing there). No Ray started."""

from __future__ import annotations

from dataclasses import fields

import pytest

from mixtrain.config import DeviceGroup, ScalingConfig
from mixtrain.errors import InputValueError
from mixtrain.train import _settings
from mixtrain.train.torch import TorchTrainer

SET = {  # a value other than the default for each refused field
    "precision": "bf16",
    "numerics_check": "strict",
    "numerics_tolerance": 1e-3,
    "max_micro_batch": [4, 4],
    "shard": "full",
    "shard_slices": [1, 2],
    "offload": "optimizer",
}


def test_every_field_is_honoured_or_refused():
    names = {f.name for f in fields(ScalingConfig)}
    assert names == _settings.HONOURED | set(_settings.REFUSED), "a new ScalingConfig field: honour it or refuse it"
    assert not _settings.HONOURED & set(_settings.REFUSED)
    assert set(SET) == set(_settings.REFUSED)


@pytest.mark.parametrize("name", sorted(f.name for f in fields(ScalingConfig)))
def test_a_loop_takes_each_fields_default_and_refuses_a_setting_it_would_ignore(name):
    TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2))  # every default is taken
    if name not in _settings.REFUSED:
        return
    with pytest.raises(InputValueError) as err:
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2, **{name: SET[name]}))
    assert f"ScalingConfig.{name}={SET[name]!r}" in str(err.value) and "leave it at" in str(err.value)


def test_the_values_a_loop_does_anyway_are_taken():
    TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2, numerics_check="off", precision="fp32"))


def test_a_groups_precision_and_a_slowdown_from_a_later_round_are_refused(monkeypatch):
    groups = [DeviceGroup(device="cpu", num_workers=1), DeviceGroup(device="cpu", precision="bf16")]
    with pytest.raises(InputValueError, match=r"DeviceGroup.precision='bf16'.*torch.autocast"):
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(groups=groups))
    capped = [DeviceGroup(device="cpu", memory="1GB"), DeviceGroup(device="cpu", memory="2GB")]
    with pytest.raises(InputValueError, match=r"DeviceGroup.memory='1GB' with a training loop.*prepare_model"):
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(groups=capped))
    with pytest.raises(InputValueError, match=r"emulate_slowdown.*from round \{1: 3\}.*no rounds"):
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2, emulate_slowdown={1: (3.0, 3)}))
    monkeypatch.setenv("MIXTRAIN_EMULATE_SLOWDOWN", "1:3@2")
    with pytest.raises(InputValueError, match="MIXTRAIN_EMULATE_SLOWDOWN"):
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2))
    TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2, emulate_slowdown={1: 3.0}))


def test_ray_trainers_other_arguments_are_taken_as_none_and_refused_when_set():
    TorchTrainer(lambda: None, torch_config=None, datasets=None, metadata=None)
    with pytest.raises(InputValueError, match=r"TorchTrainer\(datasets=\{'train': 1\}\).*prepare_data_loader"):
        TorchTrainer(lambda: None, datasets={"train": 1})


@pytest.fixture
def one_worker():
    """A loop session of one CPU worker, as a loop's prepare_* calls find it (no Ray)."""
    import torch

    from mixtrain.train import _session as sessions
    from mixtrain.train._session import LoopSession, TrainContext

    ctx = TrainContext(
        world_rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, device=torch.device("cpu"),
        experiment_name="t",
    )  # fmt: skip
    sessions.start(
        LoopSession(
            context=ctx,
            seed=0,
            shares="auto",
            bucket_bytes=1 << 20,
            report_to=lambda *a: False,
            plan_to=print,
            batch_workers=1,
        )
    )
    yield
    sessions.end()


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"move_to_device": False}, r"prepare_model\(move_to_device=False\).*get_device"),
        ({"parallel_strategy": "fsdp"}, r"parallel_strategy='fsdp'.*shard='full'"),
        ({"parallel_strategy": None}, r"parallel_strategy=None.*summed over the workers"),
        ({"parallel_strategy_kwargs": {"broadcast_buffers": False}}, r"broadcast_buffers.*False.*keeps"),
        ({"parallel_strategy_kwargs": {"mixed_precision": 1}}, r"'mixed_precision'.*no such option"),
    ],
)
def test_ray_trains_prepare_model_options_are_refused_by_name_where_mixtrain_would_not_honour_them(
    one_worker, options, refused
):
    import torch

    from mixtrain.train.torch import prepare_model

    with pytest.raises(InputValueError, match=refused):
        prepare_model(torch.nn.Linear(2, 2), **options)
    with pytest.raises(TypeError):  # a misspelt option is Python's error, as with Ray's own function
        prepare_model(torch.nn.Linear(2, 2), wrap_dpp=True)  # type: ignore[call-arg]
    ok = {"find_unused_parameters": True, "static_graph": False, "broadcast_buffers": True}
    model = prepare_model(torch.nn.Linear(2, 2), True, "ddp", ok)  # what mixtrain does anyway: taken
    assert isinstance(model.module, torch.nn.Linear)


def test_ray_trains_prepare_data_loader_options_and_samplers_mixtrain_would_replace_are_refused(one_worker):
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    from mixtrain.train.torch import prepare_data_loader

    data = TensorDataset(torch.arange(12.0))
    with pytest.raises(InputValueError, match=r"add_dist_sampler=False.*whole set"):
        prepare_data_loader(DataLoader(data, batch_size=4), add_dist_sampler=False)
    refused = [
        DataLoader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 12, 12)),
        DataLoader(data, batch_size=4, sampler=SubsetRandomSampler([0, 1, 2])),
        DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, replacement=True)),
        DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, num_samples=6)),
    ]
    for loader in refused:
        with pytest.raises(InputValueError, match=r"sampler is a \w+Sampler.*Subset\(dataset, indices\)"):
            prepare_data_loader(loader)
    taken = [
        DataLoader(data, batch_size=4, shuffle=True),
        DataLoader(data, batch_size=4, shuffle=False),
        DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 1, 0)),
    ]
    for loader in taken:
        assert len(prepare_data_loader(loader, auto_transfer=False)) == 3
