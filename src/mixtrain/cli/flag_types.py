"""What each flag's text becomes: argparse `type=` functions, each refusing a bad value with the accepted ones.

The names keep their leading underscore because argparse prints a type's `__name__` when it fails with other than
ArgumentTypeError ("invalid _early_stopping value"): renaming one would change an error message."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from mixtrain.config import MAX_SEED


def _shares(text: str) -> list[int] | str:
    if text in ("auto", "equal"):
        return text
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, equal, or a comma-separated list of integers, e.g. 40,24"
        ) from None


def _micro_batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated list, e.g. 64,16") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every micro-batch must be >= 1")
    return values


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {low}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _seed(text: str) -> int:
    value = _non_negative_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text!r} must be <= {MAX_SEED} (2**32 - 1)")
    return value


def _loggers(text: str) -> list[str]:
    from mixtrain.loggers import NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in NAMES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(NAMES)} (one, or several with commas)")
    return names


def _number(low: float, *, above: bool = False, below: float = math.inf, finite: bool = True) -> Callable[[str], float]:
    """A float flag in [low, below) ((low, below) when `above`), finite unless `finite=False`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if math.isnan(value) or (finite and math.isinf(value)):
            raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
        if value < low or (above and value == low) or value >= below:
            bound = f"> {low:g}" if above else f">= {low:g}"
            raise argparse.ArgumentTypeError(
                f"{text!r} must be {bound}" + (f" and < {below:g}" if below < math.inf else "")
            )
        return value

    return parse


_positive = _number(0, above=True)


def _text(text: str) -> str:
    if not text.strip() or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is empty")
    return text


def _workers(text: str) -> int | str | list:
    from mixtrain.config import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _metric_mode(text: str, flag: str) -> tuple[str, str, list[str]]:
    """METRIC[:min|max][:...] -> (metric, mode, the rest). The mode defaults to min for a loss, else max."""
    parts = text.split(":")
    metric = parts[0].strip()
    if not metric or "\0" in metric:  # (a NUL byte: no metric's name; EarlyStopping would refuse it without the flag)
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: name a held-out metric first, e.g. loss or accuracy:max")
    rest = parts[1:]
    if rest and rest[0] in ("min", "max"):
        return metric, rest[0], rest[1:]
    return metric, "min" if "loss" in metric else "max", rest


def _keep_best(text: str) -> tuple[str, str]:
    metric, mode, rest = _metric_mode(text, "--keep-best")
    if rest:
        raise argparse.ArgumentTypeError(f"--keep-best {text!r}: give METRIC or METRIC:min / METRIC:max")
    return metric, mode


def _early_stopping(text: str) -> tuple[str, str, int]:
    metric, mode, rest = _metric_mode(text, "--early-stopping")
    if len(rest) > 1 or (rest and not rest[0].isdigit()) or (rest and int(rest[0]) < 1):
        raise argparse.ArgumentTypeError(
            f"--early-stopping {text!r}: give METRIC[:min|max][:PATIENCE], PATIENCE an integer >= 1, e.g. loss:min:3"
        )
    return metric, mode, int(rest[0]) if rest else 3
