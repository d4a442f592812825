"""Precision policy per device kind, autocast, and the job-wide loss scale."""

from __future__ import annotations

import pytest
import torch

from mixtrain.devices import precision


@pytest.mark.parametrize(
    ("requested", "kind", "bf16", "fp16", "want"),
    [
        ("fp32", "cuda", True, True, "fp32"),
        ("auto", "cuda", True, True, "bf16"),
        ("auto", "cuda", False, True, "fp16"),  # pre-Ampere
        ("auto", "mps", True, True, "bf16"),
        ("auto", "mps", False, True, "fp16"),  # macOS before 14
        ("auto", "cpu", True, False, "fp32"),
        ("bf16", "cpu", True, False, "bf16"),
        ("fp16", "cpu", True, False, "fp32"),  # no fp16 on CPU
        ("bf16", "cuda", False, True, "fp16"),
    ],
)
def test_policy(requested, kind, bf16, fp16, want):
    assert precision.choose(requested, kind, bf16, fp16) == want


def test_unknown_precision_names_the_choices():
    with pytest.raises(ValueError, match="precision='fp8': use one of fp32, auto, bf16, fp16"):
        precision.choose("fp8", "cuda", True, True)


def test_autocast_bf16_on_cpu_runs_matmuls_in_bf16_and_fp32_is_untouched():
    a = torch.randn(4, 4)
    with precision.autocast(torch.device("cpu"), "bf16"):
        assert (a @ a).dtype == torch.bfloat16
    with precision.autocast(torch.device("cpu"), "fp32"):
        assert (a @ a).dtype == torch.float32


def test_loss_scale_halves_on_overflow_and_grows_after_good_steps():
    s = precision.LossScale(enabled=True, init=1024.0, growth_interval=3)
    s.update(False)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(True)
    assert s.scale == 1024.0
    off = precision.LossScale(enabled=False)
    off.update(False)
    assert off.scale == 1.0


def test_two_ranks_fed_the_same_verdicts_keep_the_same_scale():
    verdicts = [True, False, True, True, False, True, True, True]
    a, b = precision.LossScale(enabled=True, growth_interval=2), precision.LossScale(enabled=True, growth_interval=2)
    for v in verdicts:
        a.update(v)
        b.update(v)
        assert a.scale == b.scale


def test_loss_scale_state_round_trips():
    from mixtrain.devices.precision import LossScale

    a = LossScale(enabled=True, growth_interval=3)
    for verdict in (False, True, True):
        a.update(verdict)
    b = LossScale(enabled=True, growth_interval=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 2.0**15, "good_steps": 2}
    a.update(True), b.update(True)
    assert b.scale == a.scale == 2.0**16
