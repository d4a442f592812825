"""The parser class every subcommand's parser is, and lookups into a built parser."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from mixtrain.errors import InputValueError


class Parser(argparse.ArgumentParser):
    """Every parser of the CLI: no abbreviated flags. argparse takes any unambiguous prefix by default, so a saved
    `--trust` would have meant --trust-job, and a flag added later could change what an old prefix means."""

    reading: str | None = None
    """Set while a run folder's saved flags are parsed: an error there names the file instead of ending the
    process with argparse's usage text."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if Parser.reading is not None:
            raise InputValueError(f"{Parser.reading}: its flags do not parse ({message})")
        super().error(message)


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def other_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The other subcommand's flags: a config file for `train` may be used to `plan`, and the reverse."""
    other = "plan" if command == "train" else "train"
    return {a.dest for a in subparser(parser, other)._actions}
