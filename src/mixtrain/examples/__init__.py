"""Built-in examples on real data that ships with installed packages (no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mixtrain.task import Task


@dataclass(frozen=True)
class Example:
    task_factory: Callable[[], Task]
    train: Any
    eval: Any
    global_batch: int
    epochs: int


def load_example(name: str, *, lr: float | None = None, seed: int = 0) -> Example:
    from mixtrain.examples import digits

    examples = {"digits": digits.example}
    if name not in examples:
        raise ValueError(f"--example {name!r}: choose one of {', '.join(sorted(examples))}")
    return examples[name](lr=lr, seed=seed)
