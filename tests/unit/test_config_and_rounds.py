import pytest
import torch

from mixtrain import RunConfig, ScalingConfig, Task, Trainer
from mixtrain.records.rounds import RoundPlan, WorkerReport, next_round_steps, summarize_round, worker_times
from tests.models import factory


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_workers": 0}, r"ScalingConfig.num_workers=0"),
        ({"cpus_per_worker": 0}, r"ScalingConfig.cpus_per_worker=0"),
        ({"placement_strategy": "pack"}, r"placement_strategy='pack'.*PACK, SPREAD"),
        ({"num_workers": 2, "shares": [64]}, r"shares=\[64\]: has 1 entries but num_workers=2"),
        ({"num_workers": 2, "shares": [64, 0]}, r"every share must be an integer >= 1"),
    ],
)
def test_scaling_config_errors_name_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScalingConfig(**kwargs)


def test_run_config_errors():
    with pytest.raises(ValueError, match=r"RunConfig.steps_per_round=0"):
        RunConfig(steps_per_round=0)


def test_trainer_rejects_bad_input_before_starting_anything():
    x, y = torch.ones(10, 20), torch.zeros(10, dtype=torch.long)
    with pytest.raises(ValueError, match="global_batch=1 is smaller than num_workers=2"):
        Trainer(factory("mlp", "sgd"), (x, y), global_batch=1, scaling=ScalingConfig(num_workers=2))
    with pytest.raises(ValueError, match="empty"):
        Trainer(factory("mlp", "sgd"), (x[:0], y[:0]), global_batch=4)
    with pytest.raises(ValueError, match="strategy='ring'"):
        Trainer(factory("mlp", "sgd"), (x, y), global_batch=4, strategy="ring")
    with pytest.raises(ValueError, match="epochs=0"):
        Trainer(factory("mlp", "sgd"), (x, y), global_batch=4).fit(epochs=0)


def test_task_checks_its_fields():
    with pytest.raises(TypeError, match=r"Task\.model"):
        Task(model="m", optimizer=None, loss_fn=len)  # type: ignore[arg-type]


def test_wait_is_derived_from_the_slowest_compute():
    fast = WorkerReport(rank=0, samples=10, compute_s=[0.1, 0.1], comm_s=[0.35, 0.25], losses=[1.0, 0.5])
    slow = WorkerReport(rank=1, samples=10, compute_s=[0.4, 0.2], comm_s=[0.05, 0.15], losses=[1.0, 0.5])
    times = worker_times([fast, slow])
    assert times[0].wait_s == pytest.approx(0.4)
    assert times[0].comm_s == pytest.approx(0.2)
    assert times[1].wait_s == pytest.approx(0.0)
    record = summarize_round(
        RoundPlan(epoch=0, first_step=0, num_steps=2, shares=(10, 10), global_batch=20, drift_tolerance=1e-6),
        [slow, fast],
        wall_s=2.0,
    )
    assert record.samples == 20 and record.samples_per_s == 10 and record.loss == 0.75


def test_round_length_follows_target():
    assert next_round_steps(0.01, 1.5, None) == 150
    assert next_round_steps(10.0, 1.5, None) == 1
    assert next_round_steps(0.01, 1.5, 7) == 7
    # local SGD with H=8: whole exchanges only, so no round boundary forces an early one
    assert next_round_steps(0.01, 1.5, None, per_exchange=8) == 152
    assert next_round_steps(10.0, 1.5, None, per_exchange=8) == 8
    assert next_round_steps(0.01, 1.5, 7, per_exchange=8) == 8


def test_emulated_slowdown_from_env_and_api(monkeypatch):
    from mixtrain.config import parse_slowdown

    assert parse_slowdown("1:3, 2:1.5@4") == {1: (3.0, 0), 2: (1.5, 4)}
    assert parse_slowdown("") == {}
    with pytest.raises(ValueError, match=r"MIXTRAIN_EMULATE_SLOWDOWN item '1-3': use RANK:FACTOR\[@ROUND\]"):
        parse_slowdown("1-3")
    monkeypatch.setenv("MIXTRAIN_EMULATE_SLOWDOWN", "1:3")
    assert ScalingConfig(num_workers=2).slowdown() == {1: (3.0, 0)}
    assert ScalingConfig(num_workers=2, emulate_slowdown={0: 2.0}).slowdown() == {0: (2.0, 0)}
    assert ScalingConfig(num_workers=2, emulate_slowdown={0: (2.0, 3)}).slowdown() == {0: (2.0, 3)}
    with pytest.raises(ValueError, match=r"emulated slowdown 5:3.0"):
        ScalingConfig(num_workers=2, emulate_slowdown={5: 3.0})
    monkeypatch.delenv("MIXTRAIN_EMULATE_SLOWDOWN")
    assert ScalingConfig(num_workers=2).slowdown() == {}


def test_shares_modes():
    assert ScalingConfig().balanced and not ScalingConfig(shares="equal").balanced
    with pytest.raises(ValueError, match=r"shares='fast': use 'auto', 'equal' or a list"):
        ScalingConfig(shares="fast")
    with pytest.raises(ValueError, match=r"max_micro_batch=\[0, 4\]"):
        ScalingConfig(num_workers=2, max_micro_batch=[0, 4])


def test_the_default_is_the_hardware_there_is():
    """Unset, the workers are `auto`: one per GPU, and on a node without one a single CPU worker with every core
    (two workers sharing a laptop's cores ran at half the speed of the plain script they replaced)."""
    from mixtrain.cli.main import build_parser

    assert ScalingConfig().groups == "auto" and ScalingConfig().is_auto
    assert ScalingConfig(num_workers=3).groups is None and ScalingConfig(num_workers=3).num_workers == 3
    assert ScalingConfig(use_gpu=True).num_workers == 1 and not ScalingConfig(use_gpu=True).is_auto  # as Ray Train
    assert not ScalingConfig(resources_per_worker={"CPU": 2}).is_auto
    args = build_parser().parse_args(["train", "digits"])
    assert args.workers is None  # the CLI leaves it unset: ScalingConfig makes it auto
