"""Any value of the wrong type or range, in any config field or CLI flag, is one clear error that names the field,
never a traceback, a hang, or a started Ray (issue 33). Property-based: hypothesis draws the values."""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixtrain import DeviceGroup, LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig
from mixtrain.errors import InputError

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "equal", "cpu", "gpu", "fp32", "PACK", "allreduce", "local-sgd", "int8", ""]),
    st.lists(st.one_of(st.integers(-3, 300), st.floats(allow_nan=True), st.none(), st.text(max_size=3)), max_size=4),
    st.dictionaries(
        st.one_of(st.text(max_size=4), st.integers(-2, 4)), st.one_of(st.floats(), st.integers()), max_size=3
    ),
    st.builds(DeviceGroup),
)
ALIASES = {(StrategyConfig, "name"): "strategy=", (ScalingConfig, "emulate_slowdown"): "emulate_slowdown"}
CONFIGS = [
    (cls, f.name)
    for cls in (ScalingConfig, RunConfig, StrategyConfig, PSConfig, LocalSGDConfig, DeviceGroup)
    for f in dataclasses.fields(cls)
]


@pytest.mark.parametrize(("cls", "name"), CONFIGS, ids=[f"{c.__name__}.{n}" for c, n in CONFIGS])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=ANY_VALUE)
def test_any_value_of_any_config_field_is_taken_or_refused_by_name(cls, name, value):
    try:
        config = cls(**{name: value})
    except InputError as exc:
        assert ALIASES.get((cls, name), f"{cls.__name__}.{name}") in str(exc), str(exc)
        assert isinstance(exc, (ValueError, TypeError))
        return
    if isinstance(config, ScalingConfig) and not config.is_auto:  # what a taken config is asked later works
        config.device_groups()
        config.slowdown()


# ---- the command line ---------------------------------------------------------------------------------------


class Reached(BaseException):
    """Where training (or Ray) would start: the command passed every check."""


@contextmanager
def _nothing_starts():
    from mixtrain.cluster import connect
    from mixtrain.trainer import Trainer

    def reached(*args, **kwargs):
        raise Reached

    saved = (Trainer.fit, Trainer.plan, connect.ensure_ray, connect.start_embedded)
    Trainer.fit, Trainer.plan, connect.ensure_ray, connect.start_embedded = reached, reached, reached, reached
    try:
        yield
    finally:
        Trainer.fit, Trainer.plan, connect.ensure_ray, connect.start_embedded = saved


def _value_flags():
    """The flags of `train` that take a value, but those naming files, folders or a cluster (tested apart)."""
    from mixtrain.cli.main import _subparser, build_parser

    train = _subparser(build_parser(), "train")
    skip = {"--run-dir", "--resume", "--config", "--data-dir", "--address", "--example"}
    return sorted(
        a.option_strings[-1]
        for a in train._actions
        if a.option_strings and a.nargs is None and a.option_strings[-1] not in skip
    )


FLAG_TEXT = st.one_of(
    st.text(max_size=10),
    st.integers(-(2**40), 2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["inf", "-inf", "nan", "1e400", "0", "-1", "1,2", "auto", "equal", "cuda:1,cpu:2", "0.5", ""]),
)


@pytest.fixture(scope="module")
def digits_loaded():
    from mixtrain.job import load_job

    load_job("digits")  # once: scikit-learn's loader, so that the examples below time only the checks


@pytest.mark.parametrize("flag", _value_flags())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=FLAG_TEXT)
def test_any_value_of_any_train_flag_is_taken_or_one_line_that_names_it(flag, text, tmp_path, digits_loaded, capsys):
    from mixtrain.cli.main import main

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with _nothing_starts():
            try:
                code = main(["train", "digits", f"{flag}={text}"])
            except SystemExit as exit_:  # argparse: its usage and one error line, status 2
                code = exit_.code
            except Reached:
                return
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(("mixtrain: error:", "usage:", "mixtrain train: error:")), err
    assert any(name in last for name in _names(flag)), last


def _names(flag: str) -> set[str]:
    """What may name a flag in its error: the flag, its config field (a value only a config checks), and for
    --workers the worker count it sets."""
    dest = flag[2:].replace("-", "_")
    extra = {"--workers": {"num_workers"}, "--interface": {"network_interface"}, "--keep-all-devices": set()}
    return {flag, dest, *extra.get(flag, set())}


def test_a_resume_of_an_abused_command_json_is_one_line_or_a_run(tmp_path, digits_loaded, capsys):
    """command.json fuzzed: anything a folder can hold there ends in a resume or one line; nothing is imported."""
    from mixtrain.cli.main import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # a run: what decides is command.json
    (tmp_path / "evil.py").write_text("import pathlib\npathlib.Path('IMPORTED').write_text('ran')\n")
    cases: list[bytes | str | None] = [
        b"",
        b"{",
        b"\xff\xfe",
        b"[]",
        b"null",
        json.dumps({"argv": "digits"}).encode(),
        json.dumps({"argv": [1, 2]}).encode(),
        json.dumps({"argv": ["digits", "--epochs", "-3"]}).encode(),
        json.dumps({"argv": ["digits", "--workers", "9" * 40]}).encode(),
        json.dumps({"argv": ["digits"], "config": []}).encode(),
        json.dumps({"argv": ["digits"], "config": {"epochs": "many"}}).encode(),
        json.dumps({"argv": ["digits"], "config": {"nonsense": 1}}).encode(),
        json.dumps({"argv": ["digits"], "args": "x"}).encode(),
        json.dumps({"argv": ["digits"], "job_file": 3}).encode(),
        json.dumps({"argv": ["evil:make"], "unknown": {"deep": [1]}}).encode(),
        json.dumps({"argv": ["digits"], "config": {"task": "evil:make"}}).encode(),
        b" " * (2 << 20),
        "symlink",
        "fifo",
        "folder",
        None,
    ]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for case in cases:
            path = run / "command.json"
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
            if case == "symlink":
                path.symlink_to(tmp_path / "evil.py")
            elif case == "fifo":
                os.mkfifo(path)  # a reader that opened it normally would wait forever
            elif case == "folder":
                path.mkdir()
            elif isinstance(case, bytes):
                path.write_bytes(case)
            with _nothing_starts():
                try:
                    code = main(["train", "--resume", str(run)])
                except Reached:
                    code = 0
            err = capsys.readouterr().err
            assert code in (0, 2), (case, err)
            assert "Traceback" not in err and err.count("\n") <= 1, (case, err)
            assert not (tmp_path / "IMPORTED").exists(), case
    finally:
        os.chdir(cwd)
