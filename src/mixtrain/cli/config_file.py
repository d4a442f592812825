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

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

NOT_IN_FILES = {"help", "version", "config", "resume", "command", "verb", "job_args"}


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None


def apply_config(
    parser: argparse.ArgumentParser, path: str | Path, also_valid: set[str] | None = None
) -> dict[str, Any]:
    """Make the file's values `parser`'s defaults; return its [args] table. Keys in `also_valid` (another
    subcommand's flags, e.g. `epochs` when planning) are accepted and ignored."""
    data = read_config(path)
    job_args = data.pop("args", {})
    if not isinstance(job_args, dict):
        raise ValueError(f"{path}: args must be a table ([args] with key = value lines), got {job_args!r}")
    actions = {a.dest: a for a in parser._actions if a.dest not in NOT_IN_FILES}
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        dest = "task" if dest == "example" else dest
        if dest not in actions:
            if also_valid and dest in also_valid:
                continue
            names = ", ".join(sorted(actions))
            raise ValueError(f"{path}: unknown key {key!r}; the keys are the long flags of the command: {names}")
        defaults[dest] = _convert(actions[dest], key, value, path)
    parser.set_defaults(**defaults)
    return job_args


def _convert(action: argparse.Action, key: str, value: Any, path: str | Path) -> Any:
    where = f"{path}: {key} = {value!r}"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be true or false")
        return value
    if isinstance(value, (dict, bool)):
        raise ValueError(f"{where}: must be a number, a string or a list, like the flag's value")
    text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    if action.type is not None:
        try:
            value = action.type(text)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    else:
        value = text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: choose one of {', '.join(map(str, action.choices))}")
    return value
