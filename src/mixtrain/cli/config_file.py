"""A TOML config file for `mixtrain train` / `mixtrain plan`: the long flag names as keys.

    # run.toml
    task = "digits"                 # a built-in example, or "package.module:function"
    workers = "cuda:1,cpu:2"        # or a number
    global_batch = 128
    epochs = 5
    lr = 0.002
    strategy = "allreduce"

    [args]                          # keyword arguments for a module:function job
    hidden = 256

Flags on the command line override the file. Values go through the same checks as the flags, and a
bad one is reported with the file, the key and the accepted values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mixtrain.errors import InputValueError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

NOT_IN_FILES = {"help", "version", "config", "resume", "command", "verb", "job_args", "trust_job"}
NEVER_FROM_FILES = {
    "trust_job": "--trust-job is given on the command line only: a file must not switch off resume's refusal",
    "resume": "give --resume RUN_DIR on the command line",
}


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise InputValueError(f"--config {str(path)!r}: no such file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise InputValueError(f"{path}: not valid TOML: {exc}") from None


def split_config(data: dict[str, Any], path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the flags' keys, the [args] table)."""
    data = dict(data)
    job_args = data.pop("args", {})
    if not isinstance(job_args, dict):
        raise InputValueError(f"{path}: args must be a table ([args] with key = value lines), got {job_args!r}")
    return data, job_args


def apply_config(
    parser: argparse.ArgumentParser, path: str | Path, also_valid: set[str] | None = None
) -> dict[str, Any]:
    """Make the file's values `parser`'s defaults; return its [args] table. Keys in `also_valid` (another
    subcommand's flags, e.g. `epochs` when planning) are accepted and ignored."""
    data, job_args = split_config(read_config(path), path)
    apply_values(parser, data, path, also_valid)
    return job_args


def apply_values(
    parser: argparse.ArgumentParser, data: dict[str, Any], path: str | Path, also_valid: set[str] | None = None
) -> None:
    """Make the values of `data` (a config file's keys but [args]) `parser`'s defaults; `path` is where they came
    from, for the messages."""
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILES}
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        dest = "task" if dest == "example" else dest
        if dest in NEVER_FROM_FILES:
            raise InputValueError(f"{path}: {key} = {value!r}: {NEVER_FROM_FILES[dest]}")
        if dest not in actions:
            if also_valid and dest in also_valid:
                continue
            names = ", ".join(sorted(actions))
            raise InputValueError(f"{path}: unknown key {key!r}; the keys are the long flags of the command: {names}")
        defaults[dest] = _convert(actions[dest], key, value, path)
    parser.set_defaults(**defaults)


def _convert(action: argparse.Action, key: str, value: Any, path: str | Path) -> Any:
    where = f"{path}: {key} = {value!r}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise InputValueError(f"{where}: must be true or false")
        return value
    if isinstance(value, (dict, bool)):
        raise InputValueError(f"{where}: must be a number, a string or a list, like the flag's value")
    text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    if action.type is not None:
        try:
            value = action.type(text)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise InputValueError(f"{where}: {exc}") from None
    else:
        value = text
    if action.choices is not None and value not in action.choices:
        raise InputValueError(f"{where}: choose one of {', '.join(map(str, action.choices))}")
    return value
