"""`train --resume RUN_DIR` imports and runs the job function the run folder names: a folder from someone
else must not run code by surprise. Real files; a module that leaves a marker when it is imported."""

from __future__ import annotations

import argparse
import json

import pytest

from mixtrain.cli.main import _check_resumed_job, _parse, build_parser, main
from mixtrain.cli.saved_command import save_command
from mixtrain.job import module_file
from mixtrain.signing import sign

EVIL = "import pathlib\npathlib.Path('IMPORTED').write_text('ran')\ndef make(**kw):\n    raise SystemExit('ran')\n"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    (tmp_path / "evil.py").write_text(EVIL)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    return tmp_path


def _command(folder, signed=False, **record) -> None:
    """command.json as planted (unsigned), or as this user's mixtrain signs it."""
    (folder / "run" / "command.json").write_text(json.dumps(sign(record) if signed else record))


@pytest.mark.parametrize(
    "record",
    [
        {"argv": ["evil:make"]},  # written by hand, or by a mixtrain from before job files were recorded
        {"argv": ["evil:make"], "job_file": "/elsewhere/evil.py"},  # the module comes from another file now
        {"argv": ["evil:make", "--trust-job"], "job_file": "/elsewhere/evil.py"},  # only a flag given now counts
    ],
)
def test_resume_refuses_a_job_module_from_another_file_without_running_it(folder, record, capsys):
    _command(folder, **record)  # unsigned: refused for that alone
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert "is not signed with your key" in err and f"import and run evil:make() from {folder / 'evil.py'}" in err
    assert "--trust-job" in err and err.count("\n") == 1
    _command(folder, signed=True, **record)  # signed by this user, but the module is found in another file now
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert f"would import and run evil:make from {folder / 'evil.py'}" in err and "--trust-job" in err
    assert not (folder / "IMPORTED").exists()


def test_the_recorded_file_or_trust_job_lets_it_through(folder):
    save_command(["train", "evil:make", "--epochs", "2", "--trust-job"], folder / "run", "evil:make", {}, {})
    saved = json.loads((folder / "run" / "command.json").read_text())
    assert saved.pop("signature") and saved == {
        "argv": ["evil:make", "--epochs", "2"],
        "job": "evil:make",
        "job_file": str(folder / "evil.py"),
    }
    _check_resumed_job(build_parser().parse_args(["train", "evil:make", "--resume", "run"]))
    _command(folder, argv=["evil:make"], job_file="/elsewhere/evil.py")
    _check_resumed_job(build_parser().parse_args(["train", "evil:make", "--resume", "run", "--trust-job"]))
    _command(folder, signed=True, argv=["digits"])
    _check_resumed_job(build_parser().parse_args(["train", "digits", "--resume", "run"]))  # built-in: no file
    assert not (folder / "IMPORTED").exists()


def test_finding_a_jobs_file_runs_none_of_its_code(folder):
    pkg = folder / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(EVIL)  # even a package's __init__ stays unrun
    (pkg / "jobs.py").write_text(EVIL)
    assert module_file("pkg.jobs:make") == str(pkg / "jobs.py")
    assert module_file("pkg.nothere:make") is None and module_file("digits") is None
    assert not (folder / "IMPORTED").exists()


# ---- a run folder cannot grant itself trust, or send the run elsewhere (issue 33) ----------------------------


class Reached(BaseException):
    """Raised where training would start: the command got past every check (nothing to catch it in main())."""


@pytest.fixture
def no_training(monkeypatch):
    """Trainer.fit and Ray's start raise Reached: a test sees what a command would run, and nothing starts."""
    from mixtrain.cluster import connect
    from mixtrain.trainer import Trainer

    def reached(*args, **kwargs):
        raise Reached(kwargs.get("resume"))

    monkeypatch.setattr(Trainer, "fit", reached)
    monkeypatch.setattr(connect, "ensure_ray", reached)
    monkeypatch.setattr(connect, "start_embedded", reached)


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_of_the_cli_takes_an_abbreviated_flag():
    assert all(p.allow_abbrev is False for p in _parsers(build_parser()))
    for prefix in ("--trust", "--trust-j", "--trust-jo"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "digits", "--resume", "run", prefix])


@pytest.mark.parametrize("planted", ["--trust", "--trust-j", "--trust-job", "--trust-job=1"])
def test_a_saved_trust_flag_in_any_spelling_does_not_let_the_job_through(folder, planted, capsys, no_training):
    _command(folder, argv=["evil:make", planted], job_file="/elsewhere/evil.py")
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "command.json" in err, err
    assert not (folder / "IMPORTED").exists()


def test_a_config_file_cannot_set_trust_job(folder, capsys, no_training):
    (folder / "planted.toml").write_text('task = "evil:make"\ntrust_job = true\n')
    _command(folder, argv=["--config", str(folder / "planted.toml")], job_file="/elsewhere/evil.py")
    assert main(["train", "--resume", "run", "--config", str(folder / "planted.toml")]) == 2
    assert "trust_job = True: --trust-job is given on the command line only" in capsys.readouterr().err
    assert main(["train", str(folder / "planted.toml")]) == 2  # nor for a new run
    assert "--trust-job is given on the command line only" in capsys.readouterr().err
    _command(folder, argv=[], config={"task": "evil:make", "trust_job": True}, job_file="/elsewhere/evil.py")
    assert main(["train", "--resume", "run"]) == 2  # nor inside command.json
    assert "trust_job = True: --trust-job is given on the command line only" in capsys.readouterr().err
    assert not (folder / "IMPORTED").exists()


def test_a_saved_config_path_is_not_read_unless_given_again(folder, capsys, no_training):
    (folder / "run.toml").write_text('task = "digits"\nepochs = 2\n')
    _command(folder, signed=True, argv=["--config", str(folder / "run.toml")])  # as mixtrain 0.2 saved it
    assert main(["train", "--resume", "run"]) == 2
    err = capsys.readouterr().err
    assert f"started with --config {folder / 'run.toml'}" in err and "mixtrain train --resume run --config" in err
    with pytest.raises(Reached):
        main(["train", "--resume", "run", "--config", str(folder / "run.toml")])


@pytest.mark.parametrize(
    ("saved", "flag", "value"),
    [
        (["digits", "--address", "203.0.113.9:6379"], "--address", "203.0.113.9:6379"),
        (["digits", "--interface", "eth0"], "--interface", "eth0"),
    ],
)
def test_where_a_run_connects_is_taken_from_the_command_line_only(folder, saved, flag, value, capsys, no_training):
    _command(folder, signed=True, argv=saved)
    connected = []
    import mixtrain.cluster.headnode as headnode

    original = headnode.use_cluster_token
    headnode.use_cluster_token = lambda address: connected.append(address)  # the first thing --address does
    try:
        assert main(["train", "--resume", "run"]) == 2
        err = capsys.readouterr().err
        assert f"the run was started with {flag} {value}" in err and f"--resume run {flag} {value}" in err
        assert connected == []
        with pytest.raises(Reached):  # given again now: resumed as asked
            main(["train", "--resume", "run", flag, value])
    finally:
        headnode.use_cluster_token = original
    args, _ = _parse(["train", "--resume", "run", flag, "other"])
    assert getattr(args, flag[2:]) == "other"


def test_a_saved_run_dir_resume_or_help_changes_nothing(folder, capsys, no_training):
    _command(folder, argv=["digits", "--run-dir", str(folder / "elsewhere"), "--resume", str(folder / "other")])
    args, _ = _parse(["train", "--resume", "run"])
    assert (args.run_dir, args.resume, args.trust_job) == (None, "run", False)
    for planted in ("--help", "-h", "--version"):
        _command(folder, argv=["digits", planted])
        assert main(["train", "--resume", "run"]) == 2
        assert f"holds {planted}, which a run folder may not set" in capsys.readouterr().err


def test_a_new_runs_config_is_saved_inside_command_json_not_as_a_path(folder, no_training):
    (folder / "run.toml").write_text('task = "digits"\nepochs = 2\nrun_dir = "x"\nseed = 3\n')
    with pytest.raises(Reached):
        main(["train", str(folder / "run.toml"), "--run-dir", "mine", "--lr", "0.5"])
    saved = json.loads((folder / "mine" / "command.json").read_text())
    assert saved["argv"] == ["--lr", "0.5"] and saved["config"] == {"task": "digits", "epochs": 2, "seed": 3}
    (folder / "run.toml").write_text('task = "evil:make"\n')  # changed afterwards: the resume does not read it
    (folder / "mine" / "checkpoints").mkdir()
    args, _ = _parse(["train", "--resume", "mine"])
    assert (args.task, args.epochs, args.seed, args.lr) == ("digits", 2, 3, 0.5)
