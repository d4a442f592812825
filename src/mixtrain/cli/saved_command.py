"""`command.json`: the flags a CLI run was started with, so that `mixtrain train --resume RUN_DIR` needs no others.

A run folder is a file anyone can hand you, so what it says is data, never trust:

- it names the job to run again and its arguments, the loggers and every other flag: the record is signed with this
  user's key (signing.py), and `check_resumed_job` (cli/resume.py) refuses a record that is unsigned or signed with
  another key, or a module that would now load from another file than the run recorded, unless `--trust-job` is
  given on this command line;
- `--trust-job`, `--run-dir` and `--resume` count only when given now;
- where the run connects and what it opens (`--address`, `--interface`) is never taken from the folder: a folder
  that names them must be resumed with them given again (`mixtrain train --resume RUN --address HOST:PORT`,
  which the resume hint prints), so a planted folder cannot send your job and data to a foreign Ray head;
- a TOML config is kept inside command.json (its keys, as read when the run started), not as a path to a file
  that could change or be planted later.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixtrain._files import RunFolder
from mixtrain.errors import InputValueError
from mixtrain.signing import sign_if_possible, signed_by_me

COMMAND_FILE = "command.json"
MAX_BYTES = 1 << 20
"""A command.json is a few hundred bytes; a larger one (or a FIFO, /dev/zero behind a symlink) is refused unread."""

REDIRECTS = {"address": "--address", "interface": "--interface"}
"""Flags that decide which machines a run reaches and what it opens: given now, or the resume is refused."""
NOW_ONLY = {"trust_job": "--trust-job", "run_dir": "--run-dir", "resume": "--resume"}
"""Flags that count only when given on this command line, whatever a saved argv says."""
NOT_SAVED = ("--resume", "--run-dir", "--trust-job", "--config")
"""Left out of the saved argv (the config file's keys are saved instead of its path)."""
REFUSED = ("-h", "--help", "--version")


@dataclass(frozen=True)
class SavedCommand:
    """What command.json records, checked."""

    argv: list[str]
    """The flags given when the run started, without those in NOT_SAVED."""
    config: dict[str, Any] = field(default_factory=dict)
    """The TOML config's keys (but [args]), as read when the run started."""
    job_args: dict[str, Any] = field(default_factory=dict)
    """The TOML config's [args] table: keyword arguments for a module:function job."""
    job: str | None = None
    job_file: str | None = None
    """The file the job's module was loaded from when the run started (None: a built-in or not recorded)."""
    legacy_config: str | None = None
    """A config file path saved by mixtrain before 0.3 (in argv as --config PATH): read again only if given now."""
    signed: bool = False
    """Whether this user's key signed the record as it is (signing.py); else it runs only with --trust-job."""


def save_command(raw: list[str], run_dir: Path, target: str, config: dict[str, Any], job_args: dict[str, Any]) -> None:
    """Write RUN_DIR/command.json for a new run (raw: the command line, "train" first)."""
    from mixtrain.job import module_file

    keep: list[str] = []
    skip = False
    for item in raw[1:]:
        if skip:
            skip = False
        elif item in NOT_SAVED:
            skip = item != "--trust-job"
        elif not item.startswith(tuple(f"{flag}=" for flag in NOT_SAVED)):
            keep.append(item)
    for i, item in enumerate(keep[:-1]):  # a data folder found again from any folder
        if item == "--data-dir":
            keep[i + 1] = str(Path(keep[i + 1]).expanduser().resolve())
    config = {k: v for k, v in config.items() if k.replace("-", "_") != "run_dir"}  # the folder is the run
    if isinstance(config.get("data_dir", config.get("data-dir")), str):
        key = "data_dir" if "data_dir" in config else "data-dir"
        config[key] = str(Path(config[key]).expanduser().resolve())
    from mixtrain.observe.runlog import make_folder

    make_folder(run_dir, "--run-dir")  # a file or a dangling link in the way is one clear line
    record: dict[str, Any] = {"argv": keep, "job": target, "job_file": module_file(target)}
    if config:
        record["config"] = config
    if job_args:
        record["args"] = job_args
    with RunFolder(run_dir) as folder:
        folder.write_json(COMMAND_FILE, sign_if_possible(record, _say))


def read_command(run_dir: str | Path) -> SavedCommand | None:
    """RUN_DIR/command.json checked, or None when there is none (a run started from Python, or by hand).
    Anything malformed is an InputValueError that names the file and what is wrong; nothing is followed
    through a symlink, and nothing but a small regular file is read."""
    data = read_record(run_dir)
    if data is None:
        return None
    path = Path(run_dir) / COMMAND_FILE
    if isinstance(data, dict) and data.get("command") == "run":
        raise InputValueError(
            f"--resume {str(run_dir)!r} holds a loop run ({path} names {data.get('target')!r:.200}): continue it "
            f"with mixtrain run TARGET --resume {run_dir}"
        )
    return _checked(data, path, run_dir)


def read_record(run_dir: str | Path) -> Any:
    """RUN_DIR/command.json's JSON, unchecked, or None when there is none: a small regular file, read without
    following a symlink or blocking on a FIFO (one line otherwise)."""
    path = Path(run_dir) / COMMAND_FILE
    try:  # the run folder's one way: no link, no pipe, at most MAX_BYTES
        with RunFolder(run_dir) as folder:
            text = folder.read(COMMAND_FILE, MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputValueError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputValueError(f"{path}: not valid JSON ({exc}); {_fix(run_dir)}") from None


def _fix(run_dir: str | Path) -> str:
    return (
        f"it records the flags the run started with. Move it aside and resume with every flag given again: "
        f"mixtrain train TASK --resume {run_dir} [flags]"
    )


def _checked(data: Any, path: Path, run_dir: str | Path) -> SavedCommand:
    if not isinstance(data, dict):
        raise InputValueError(f"{path}: not a JSON object; {_fix(run_dir)}")
    argv = data.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise InputValueError(f"{path}: 'argv' must be a list of strings, got {argv!r:.200}; {_fix(run_dir)}")
    refused = [a for a in argv if a in REFUSED or a.startswith(("--help=", "--version="))]
    if refused:
        raise InputValueError(f"{path}: 'argv' holds {refused[0]}, which a run folder may not set; {_fix(run_dir)}")
    for key in ("config", "args"):
        if not isinstance(data.get(key, {}), dict):
            raise InputValueError(f"{path}: {key!r} must be a JSON object, got {data[key]!r:.200}; {_fix(run_dir)}")
    for key in ("job", "job_file"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise InputValueError(f"{path}: {key!r} must be a string, got {data[key]!r:.200}; {_fix(run_dir)}")
    legacy = None
    if "--config" in argv[:-1]:  # written before 0.3: a path, which is read again only if given now
        i = argv.index("--config")
        legacy, argv = argv[i + 1], [*argv[:i], *argv[i + 2 :]]
    return SavedCommand(
        argv=[a for a in argv if a != "--trust-job"],  # only a flag given now counts
        config=dict(data.get("config", {})),
        job_args=dict(data.get("args", {})),
        job=data.get("job"),
        job_file=data.get("job_file"),
        legacy_config=legacy,
        signed=signed_by_me(data),
    )


def loop_target(target: str) -> str:
    """How a `mixtrain run` target is recorded and compared: a script by its full path, a function as written."""
    return str(Path(target).expanduser().resolve()) if target.endswith(".py") else target


def save_loop_command(run_dir: Path, target: str) -> None:
    """RUN_DIR/command.json for a new `mixtrain run`: the loop's target, signed, so that a resume (or another
    run pointed at the folder) can tell whether it continues the same loop."""
    from mixtrain._files import write_json
    from mixtrain.job import module_file
    from mixtrain.observe.runlog import make_folder

    make_folder(run_dir, "--run-dir")
    record = {"command": "run", "target": loop_target(target), "target_file": module_file(target)}
    write_json(sign_if_possible(record, _say), run_dir / COMMAND_FILE)


def _say(line: str) -> None:
    print(f"mixtrain: {line}", file=sys.stderr)


def redirect_error(resume: str, flag: str, value: Any) -> InputValueError:
    return InputValueError(
        f"--resume {resume!r}: the run was started with {flag} {value}; a resume takes {flag} only from this "
        f"command line (a run folder must not choose where your job and data go, or what this machine opens). "
        f"Check it, then resume with: mixtrain train --resume {resume} {flag} {value}"
    )
