"""Bad input and failing workers give clear errors, fast, and no hang."""

import time

import pytest
import torch

import mixtrain
from mixtrain import RunConfig, ScalingConfig, Trainer, WorkerError
from tests.models import data, factory, raising_factory

pytestmark = pytest.mark.usefixtures("ray_session")


def test_factory_that_raises_on_a_worker_carries_its_traceback(tmp_path):
    x, y = data("mlp", 64)
    trainer = Trainer(raising_factory, (x, y), global_batch=16, run=RunConfig(run_dir=str(tmp_path), progress=False))
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    assert time.monotonic() - t0 < 30
    message = str(info.value)
    assert "failed in build()" in message
    assert "boom from the user's factory" in message
    assert "raising_factory" in message  # the worker's traceback, not just the message


def test_factory_returning_the_wrong_type(tmp_path):
    x, y = data("mlp", 64)
    trainer = Trainer(
        lambda: torch.nn.Linear(2, 2), (x, y), global_batch=16, run=RunConfig(run_dir=str(tmp_path), progress=False)
    )
    with pytest.raises(WorkerError, match=r"must return mixtrain.Task"):
        trainer.fit()


def test_impossible_placement_fails_fast_with_the_inventory(tmp_path):
    x, y = data("mlp", 64)
    trainer = Trainer(
        factory("mlp", "sgd"),
        (x, y),
        global_batch=16,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=3),
        run=RunConfig(run_dir=str(tmp_path), progress=False),
    )
    t0 = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"cannot hold these workers: CPU: 6 needed, 4 in the cluster.*Cluster: node .*CPU=4"
    ):
        trainer.fit()
    assert time.monotonic() - t0 < 10


def test_resources_held_elsewhere_time_out_with_the_inventory(tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("MIXTRAIN_PLACEMENT_TIMEOUT_S", "2")
    mixtrain.release_workers()  # workers kept from earlier tests hold CPUs too
    hog = ray.util.placement_group([{"CPU": 3}])
    ray.get(hog.ready())
    try:
        x, y = data("mlp", 64)
        trainer = Trainer(
            factory("mlp", "sgd"),
            (x, y),
            global_batch=16,
            scaling=ScalingConfig(num_workers=2),
            run=RunConfig(run_dir=str(tmp_path), progress=False),
        )
        with pytest.raises(RuntimeError, match=r"could not reserve 2 workers.*within 2 s.*free: CPU=1"):
            trainer.fit()
    finally:
        ray.util.remove_placement_group(hog)


def test_factory_from_a_module_workers_cannot_import_says_how_to_fix(tmp_path, monkeypatch):
    import sys
    import types

    module = types.ModuleType("only_on_the_driver")
    exec("from tests.models import make_task\ndef make():\n    return make_task('mlp', 'sgd')\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_on_the_driver", module)
    x, y = data("mlp", 64)
    trainer = Trainer(module.make, (x, y), global_batch=16, run=RunConfig(run_dir=str(tmp_path), progress=False))
    with pytest.raises(WorkerError) as info:
        trainer.fit()
    message = str(info.value)
    assert "No module named 'only_on_the_driver'" in message
    assert "must be importable on every worker" in message
    assert "\x1b[" not in message  # no terminal colour codes from Ray


def test_workers_that_build_different_models_are_refused_naming_the_parameter_and_both_shapes(tmp_path):
    import functools

    from mixtrain.group.preflight import PreflightError
    from tests.models import one_worker_builds_another_model

    x, y = data("mlp", 64)
    task = functools.partial(one_worker_builds_another_model, str(tmp_path / "first"))
    trainer = Trainer(
        task,
        (x, y),
        global_batch=16,
        scaling=ScalingConfig(num_workers=2),
        run=RunConfig(run_dir=str(tmp_path / "run"), progress=False),
    )
    with pytest.raises(PreflightError) as info:
        trainer.fit()
    text = str(info.value)
    assert "its model differs from worker" in text and "0.weight is (" in text, text
    assert "(48, 20) float32" in text and "(32, 20) float32" in text, text


def test_dict_samples_with_loss_fn_are_refused_before_any_step_with_the_fix(tmp_path):
    # a Hugging Face dataset's dicts and a task with loss_fn: the worker called model(*batch) with the dict's
    # keys, and the user saw "linear(): argument 'input' must be Tensor, not str" from deep inside the model
    from tests.datasets import DictSamples

    x, y = data("mlp", 64)
    trainer = Trainer(
        factory("mlp", "sgd"),
        DictSamples(x, y),
        global_batch=16,
        run=RunConfig(run_dir=str(tmp_path), progress=False),
    )
    with pytest.raises(ValueError) as info:
        trainer.fit()
    message = str(info.value)
    assert "\n" not in message and "the samples are dicts (keys 'x', 'y')" in message, message
    assert "compute_loss=lambda m, b: m(**b).loss" in message and "Tensor, not str" not in message
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
