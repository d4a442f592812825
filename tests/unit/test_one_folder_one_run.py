"""One folder, one run: a resume continues in its own folder with its own job or loop, a new run never writes into
a folder that holds one, and a folder that holds no run is bad input (exit 2, one line). Real folders; training is
stopped where it would start (nothing here needs Ray)."""

from __future__ import annotations

import json

import pytest

from mixtrain.cli.main import main
from mixtrain.signing import sign


class Reached(BaseException):
    """Raised where training would start: the command got past every check."""


@pytest.fixture
def here(tmp_path, monkeypatch):
    from mixtrain.train.torch import TorchTrainer
    from mixtrain.trainer import Trainer

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MIXTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(Trainer, "fit", reached)
    monkeypatch.setattr(TorchTrainer, "fit", reached)
    (tmp_path / "loops.py").write_text("def train_func(config):\n    pass\n\ndef other(config):\n    pass\n")
    return tmp_path


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def _run(folder, record: dict, signed: bool = True) -> None:
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    (folder / "command.json").write_text(json.dumps(sign(record) if signed else record))


def test_a_resume_writes_into_no_other_run_folder(here, capsys):
    _run(here / "a", {"argv": ["digits"]})
    _run(here / "b", {"argv": ["digits"]})
    before = (here / "b" / "command.json").read_bytes()
    assert main(["train", "--resume", "a", "--run-dir", "b"]) == 2
    assert "a resumed run continues in its own folder" in _err(capsys)
    assert (here / "b" / "command.json").read_bytes() == before
    with pytest.raises(Reached):  # the same folder, however written
        main(["train", "--resume", "a", "--run-dir", str(here / "a")])


def test_a_folder_that_holds_no_run_is_bad_input_not_a_failed_job(here, capsys):
    (here / "empty").mkdir()
    assert main(["train", "--resume", "empty"]) == 2
    assert "that folder holds no run (no checkpoints/ in it)" in _err(capsys)
    (here / "empty" / "command.json").write_text(json.dumps(sign({"argv": ["digits"]})))  # started, never saved
    assert main(["train", "--resume", "empty"]) == 2
    assert "holds no run" in _err(capsys)


def test_a_loop_folder_is_resumed_as_a_loop_with_its_own_target(here, capsys):
    with pytest.raises(Reached):
        main(["run", "loops:train_func", "--run-dir", "loop"])
    record = json.loads((here / "loop" / "command.json").read_text())
    assert record["command"] == "run" and record["target"] == "loops:train_func"
    assert record["target_file"] == str(here / "loops.py")
    with pytest.raises(Reached):  # the same loop again, before it reported a checkpoint: started over
        main(["run", "loops:train_func", "--run-dir", "loop"])
    assert main(["run", "loops:other", "--run-dir", "loop"]) == 2  # another loop's folder
    assert "--run-dir 'loop' holds a run already (of loops:train_func): continue it with" in _err(capsys)
    (here / "loop" / "checkpoints").mkdir()
    assert main(["run", "loops:train_func", "--run-dir", "loop"]) == 2  # a new run in a folder that holds one
    assert "mixtrain run loops:train_func --resume loop" in _err(capsys)
    assert main(["run", "loops:other", "--resume", "loop"]) == 2  # another loop on its checkpoints
    assert "holds a run of loops:train_func, not of loops:other: one folder holds one run" in _err(capsys)
    assert main(["train", "--resume", "loop"]) == 2
    err = _err(capsys)
    assert "holds a loop run" in err and "continue it with mixtrain run TARGET --resume loop" in err
    with pytest.raises(Reached):
        main(["run", "loops:train_func", "--resume", "loop"])


def test_an_unsigned_loop_record_needs_trust_job(here, capsys):
    _run(here / "loop", {"command": "run", "target": "loops:train_func"}, signed=False)
    assert main(["run", "loops:train_func", "--resume", "loop"]) == 2
    err = _err(capsys)
    assert "is not signed with your key" in err and "a run of loops:train_func" in err and "--trust-job" in err
    with pytest.raises(Reached):
        main(["run", "loops:train_func", "--resume", "loop", "--trust-job"])
    assert main(["run", "loops:other", "--resume", "loop", "--trust-job"]) == 2  # trusted: still one run a folder
    assert "one folder holds one run" in _err(capsys)
