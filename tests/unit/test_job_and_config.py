"""Jobs by name or package.module:function, and TOML config files read into the CLI's flags."""

import argparse
import sys
import textwrap

import pytest
import torch

from mixtrain.cli.config_file import apply_config
from mixtrain.cli.main import _parse, build_parser
from mixtrain.job import Job, load_job


def test_builtin_examples_load_offline_with_held_out_data():
    digits = load_job("digits")
    assert len(digits.train_data[0]) == 1438 and len(digits.eval_data[0]) == 359
    chars = load_job("chars", lr=1e-3, args={"max_chars": 20_000})
    windows = chars.train_data()  # built on each worker: a TokenWindows over its own token file
    x, y = torch.utils.data.default_collate([windows[i] for i in range(len(windows))])
    assert x.shape[1] == 64 and (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
    task = chars.task_factory()
    assert task.optimizer.param_groups[0]["lr"] == 1e-3
    assert task.model(x[:2]).shape == (2, 64, task.model.head.out_features)


def test_unknown_example_and_bad_targets_say_what_to_write():
    with pytest.raises(
        ValueError, match=r"--example 'imagenet': choose a built-in example \(digits, chars, chars-large, mnist\)"
    ):
        load_job("imagenet", flag="--example")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        load_job("no_such_module_xyz:make")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_job("mixtrain.examples.digits:nope")
    with pytest.raises(ValueError, match="the mnist example needs --data-dir DIR"):
        load_job("mnist")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userjob_mod.py").write_text(
        textwrap.dedent(
            """
            import functools, torch
            import mixtrain

            def make_task(width):
                model = torch.nn.Linear(2, width)
                return mixtrain.Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     loss_fn=torch.nn.functional.cross_entropy)

            def job(width=2, seed=0):
                x = torch.randn(16, 2, generator=torch.Generator().manual_seed(seed))
                return mixtrain.Job(functools.partial(make_task, width), (x, (x[:, 0] > 0).long()), global_batch=8)

            def not_a_job():
                return 42
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop("userjob_mod", None)


def test_module_function_gets_its_arguments_and_must_return_a_job(user_module):
    job = load_job("userjob_mod:job", seed=3, args={"width": 5})
    assert isinstance(job, Job) and job.task_factory().model.out_features == 5
    with pytest.raises(ValueError, match=r"\[args\] depth = 3: userjob_mod:job takes no argument 'depth'"):
        load_job("userjob_mod:job", args={"depth": 3})
    with pytest.raises(ValueError, match=r"--lr 0\.5: userjob_mod:job takes no 'lr' argument"):
        load_job("userjob_mod:job", lr=0.5)
    with pytest.raises(TypeError, match=r"returned int; a job function returns mixtrain\.Job"):
        load_job("userjob_mod:not_a_job")


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_toml_keys_become_flag_defaults_and_flags_win(tmp_path):
    path = _write(
        tmp_path,
        """
        task = "chars"
        workers = "cpu:2"
        global-batch = 32
        shares = [20, 12]
        epochs = 4
        lr = 0.001
        strategy = "local-sgd"
        keep_all_devices = true
        [args]
        max_chars = 5000
        """,
    )
    args, raw = _parse(["train", path, "--epochs", "2"])
    assert raw == ["train", "--config", path, "--epochs", "2"]
    assert (args.task, args.global_batch, args.shares, args.epochs, args.lr) == ("chars", 32, [20, 12], 2, 0.001)
    assert args.strategy == "local-sgd" and args.keep_all_devices and args.job_args == {"max_chars": 5000}
    assert [(g.device, g.num_workers) for g in args.workers] == [("cpu", 2)]
    plan_args, _ = _parse(["plan", "--config", path])  # train-only keys are accepted, and ignored, by plan
    assert plan_args.task == "chars" and not hasattr(plan_args, "epochs")


def test_local_sgd_flags_reach_the_strategy():
    from mixtrain.cli.main import _trainer

    argv = ["train", "digits", "--strategy", "local-sgd", "--local-steps", "16", "--overlap", "--compress", "int4"]
    args, _ = _parse([*argv, "--outer-lr", "0.7", "--outer-momentum", "0.9"])
    strategy = _trainer(args)[1].strategy
    options = strategy.local_sgd
    assert (options.local_steps, options.overlap, strategy.compress) == (16, True, "int4")
    assert (options.outer_lr, options.outer_momentum) == (0.7, 0.9)
    plain = _trainer(_parse(["train", "digits", "--strategy", "local-sgd"])[0])[1].strategy.local_sgd
    assert (plain.overlap, plain.outer_lr, plain.outer_momentum) == (False, 1.0, 0.0)  # plain averaging


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('strategy = "gossip"', "strategy = 'gossip': choose one of allreduce, ps, ps-async, local-sgd"),
        ("global_batch = 0", "global_batch = 0: '0' must be >= 1"),
        ('workers = "tpu:2"', "workers = 'tpu:2': "),
        ("keep_all_devices = 1", "keep_all_devices = 1: must be true or false"),
        ("epoch = 3", "unknown key 'epoch'; the keys are the long flags of the command: "),
        ("lr = [1, 2]", "lr = [1, 2]: '1,2' is not a number"),
        ("args = 3", "args must be a table"),
    ],
)
def test_a_bad_toml_value_names_the_file_the_key_and_the_fix(tmp_path, line, message):
    path = _write(tmp_path, line)
    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    with pytest.raises(ValueError) as err:
        apply_config(train, path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_toml_syntax_error_and_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        _parse(["train", _write(tmp_path, "epochs = = 3")])
    with pytest.raises(ValueError, match=r"--config 'nope\.toml': no such file"):
        _parse(["train", "--config", "nope.toml"])


def test_resume_takes_the_runs_own_job_and_lets_other_flags_override(tmp_path):
    (tmp_path / "command.json").write_text('{"argv": ["chars", "--workers", "2", "--epochs", "3"]}')
    (tmp_path / "checkpoints").mkdir()
    args, _ = _parse(["train", "--resume", str(tmp_path), "--epochs", "5"])
    assert (args.task, args.workers, args.epochs, args.resume) == ("chars", 2, 5, str(tmp_path))
    with pytest.raises(ValueError, match="continues the run's own job"):
        _parse(["train", "--resume", str(tmp_path), "digits"])


def test_both_doors_name_the_run_folder_storage_path_and_the_old_task_name_still_works_with_a_warning(tmp_path):
    import dataclasses
    from pathlib import Path

    import mixtrain.train
    from mixtrain.config import RunConfig as TaskRun
    from mixtrain.result import Result as TaskResult
    from mixtrain.train._result import Result as LoopResult

    assert TaskRun(storage_path="runs").storage_path == mixtrain.train.RunConfig(storage_path="runs").storage_path
    with pytest.warns(DeprecationWarning, match="storage_dir is deprecated: use storage_path"):
        old = TaskRun(storage_dir="runs")
    assert old.storage_path == "runs" and old.storage_dir is None
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="storage_dir='a' with storage_path='b'"):
        TaskRun(storage_dir="a", storage_path="b")
    task = TaskResult(run_dir=tmp_path, model_path=tmp_path / "m", state_dict={}, workers=[{"rank": 0}])
    loop = LoopResult(metrics={}, checkpoint=None, path=str(tmp_path), workers=[{"rank": 0}])
    for result in (task, loop):  # the fields both doors share read the same
        assert (result.run_dir, result.path, result.metrics, result.workers) == (
            Path(tmp_path),
            str(tmp_path),
            {},
            [{"rank": 0}],
        )
    assert "storage_path" in {f.name for f in dataclasses.fields(TaskRun)}
