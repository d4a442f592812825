"""The errors mixtrain raises for bad input. No torch or Ray here: the CLI and the configs use them.

A bad value (a config field, a flag, a TOML key, a run folder's file, the data) raises `InputValueError` or
`InputTypeError`: a ValueError / TypeError like any other (code that catches those keeps working), and an
`InputError`, so the CLI can tell bad input (one line, exit status 2) from a bug (a traceback to report).
Each message names the field, the value and the fix."""

from __future__ import annotations


class InputError(Exception):
    """Bad input to mixtrain; the message names the field, the value and the fix."""


class InputValueError(InputError, ValueError):
    """A value out of range or not one of the accepted ones."""


class InputTypeError(InputError, TypeError, ValueError):
    """A value of the wrong type. Also a ValueError: code that catches ValueError for a bad setting (as mixtrain's
    checks raised for every bad value before they told types apart) still catches it."""


class MetricMissing(InputValueError):
    """A setting names a held-out metric the evaluation does not have (EarlyStopping.metric, RunConfig.keep_best):
    not a callback's bug to note and go on past, but the run's own setting, so the run stops at that evaluation."""


class MissingExtraError(InputError, ImportError):
    """A feature needs a package that is an optional extra of mixtrain; the message gives the pip install."""


def require(module: str, package: str, extra: str, what: str) -> None:
    """Import `module` (to check it is there) or raise MissingExtraError naming `what` needs and the fix."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(
            f'{what} needs {package}, which is not installed: pip install "mixtrain[{extra}]" (or pip install '
            f"{package})"
        ) from None
