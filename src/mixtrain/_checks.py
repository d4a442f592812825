"""Checks for the configs' fields: each raises an InputValueError / InputTypeError that names the field, the value
and what is accepted. No torch here."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from mixtrain.errors import InputTypeError, InputValueError


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(
    name: str, value: Any, low: int | None = None, high: int | None = None, *, none: bool = False, hint: str = ""
) -> None:
    """An int (not a bool) in [low, high]; None too when `none`. `hint` follows the message (what a value means)."""
    if value is None and none:
        return
    hint = f" ({hint})" if hint else ""
    if not isinstance(value, int) or isinstance(value, bool):
        also = " or None" if none else ""
        raise InputTypeError(f"{name}={_shown(value)}: must be an integer{also}{hint}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InputValueError(f"{name}={_shown(value)}: must be an integer {_range(low, high)}{hint}")


def number(
    name: str,
    value: Any,
    low: float | None = None,
    *,
    above: bool = False,
    below: float | None = None,
    finite: bool = True,
    none: bool = False,
) -> None:
    """A real number (int or float, not a bool) >= low (> low when `above`) and < below; finite unless
    `finite=False` (infinity then means "never"); None too when `none`."""
    if value is None and none:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InputTypeError(f"{name}={_shown(value)}: must be a number{' or None' if none else ''}")
    if math.isnan(value) or (finite and math.isinf(value)):
        raise InputValueError(f"{name}={_shown(value)}: must be a finite number")
    too_low = low is not None and (value < low or (above and value == low))
    if too_low or (below is not None and value >= below):
        bound = [f"> {low:g}" if above else f">= {low:g}"] if low is not None else []
        bound += [f"< {below:g}"] if below is not None else []
        raise InputValueError(f"{name}={_shown(value)}: must be a number {' and '.join(bound)}")


def boolean(name: str, value: Any, *, none: bool = False) -> None:
    if value is None and none:
        return
    if not isinstance(value, bool):
        raise InputTypeError(f"{name}={_shown(value)}: must be True or False{' (or None)' if none else ''}")


def choice(name: str, value: Any, allowed: Collection[Any]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise InputValueError(f"{name}={_shown(value)}: use one of {', '.join(map(str, allowed))}")


def text(name: str, value: Any, *, none: bool = False, empty: bool = False) -> None:
    """A string (non-empty unless `empty`); None too when `none`."""
    if value is None and none:
        return
    if not isinstance(value, str) or (not empty and not value) or "\0" in value:
        raise InputTypeError(f"{name}={_shown(value)}: must be a non-empty string{' or None' if none else ''}")


def _range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"from {low} to {high}"
    return f">= {low}" if low is not None else f"<= {high}"
