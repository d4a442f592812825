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
