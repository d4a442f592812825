"""What `mixtrain train` trains: a built-in example or a user's `package.module:function`, as one Job.

A job function returns `mixtrain.Job(task_factory=..., train_data=..., eval_data=..., global_batch=...)`.
It runs on the driver (it loads the data); the task factory it names runs on every worker. It may take
any of the keyword arguments `lr`, `seed` and `data_dir` (the CLI flags of those names) and any others
a TOML config lists under `[args]`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.task import Task

if TYPE_CHECKING:
    from mixtrain.trainer import Trainer

BUILTIN = {
    "digits": "mixtrain.examples.digits:example",
    "chars": "mixtrain.examples.chars:example",
    "chars-large": "mixtrain.examples.chars_large:example",
    "mnist": "mixtrain.examples.mnist:example",
}
"""Built-in examples by name: each a job function like a user's."""


@dataclass(frozen=True)
class Job:
    """A training job: the replica each worker builds, the data, and the defaults the CLI starts from."""

    task_factory: Callable[[], Task]
    """Called on every worker; returns mixtrain.Task(model=..., optimizer=..., loss_fn=...)."""
    train_data: Any
    """A tuple of tensors/arrays (inputs..., target), a map-style Dataset (read lazily on each worker), a
    mixtrain.data.Loader, or a zero-argument function that builds the Dataset on each worker."""
    eval_data: Any = None
    """Held-out data in the same forms (optional): loss, accuracy for class targets, or the Task's metrics."""
    global_batch: int = 64
    """Samples per step over all workers (--global-batch overrides)."""
    epochs: int = 1
    """Epochs when --epochs is not given."""

    def __post_init__(self) -> None:
        if not callable(self.task_factory):
            raise InputTypeError("Job.task_factory must be a callable that returns mixtrain.Task(...)")
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise InputValueError(f"Job.global_batch={self.global_batch!r}: must be an integer >= 1")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise InputValueError(f"Job.epochs={self.epochs!r}: must be an integer >= 1")

    def trainer(self, global_batch: int | None = None, **options: Any) -> Trainer:
        """A Trainer for this job; `options` are Trainer's (scaling=, run=, strategy=).
        `job.trainer(scaling=ScalingConfig(num_workers=2)).fit(epochs=job.epochs)` trains it."""
        from mixtrain.trainer import Trainer

        return Trainer(
            self.task_factory,
            self.train_data,
            eval_data=self.eval_data,
            global_batch=global_batch or self.global_batch,
            **options,
        )


def load_job(
    target: str,
    *,
    lr: float | None = None,
    seed: int = 0,
    data_dir: str | None = None,
    args: dict[str, Any] | None = None,
    flag: str = "task",
) -> Job:
    """Build the job named by `target`: a built-in example name or `package.module:function`.
    `flag` names where the target came from, for error messages."""
    if ":" not in target:
        if target not in BUILTIN:
            raise InputValueError(
                f"{flag} {target!r}: choose a built-in example ({', '.join(BUILTIN)}) or give your own job "
                "function as package.module:function"
            )
        fn = _import(BUILTIN[target], flag)
    else:
        fn = _import(target, flag)
    given: dict[str, Any] = {"seed": seed}
    if lr is not None:
        given["lr"] = lr
    if data_dir is not None:
        given["data_dir"] = data_dir
    job = _call(fn, target, given, dict(args or {}), flag)
    if not isinstance(job, Job):
        raise InputTypeError(
            f"{flag} {target!r} returned {type(job).__name__}; a job function returns "
            "mixtrain.Job(task_factory=..., train_data=..., eval_data=..., global_batch=...)"
        )
    return job


def _search_path() -> list[str]:
    """Where a job module is looked for: sys.path, with the current folder first (as `python -m` has it)."""
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    return sys.path


def module_file(target: str) -> str | None:
    """The file that `package.module:function` would be imported from here, found without running any of
    its code (not even its packages' __init__); None for a built-in example or a module that is not found."""
    from importlib.machinery import PathFinder

    if ":" not in target:
        return None
    parts = target.partition(":")[0].split(".")
    search: list[str] | None = _search_path()
    spec = None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    return str(Path(spec.origin).resolve()) if spec is not None and spec.origin else None


def import_target(target: str, flag: str) -> Callable[..., Any]:
    """The function `package.module:function` names, imported as a job function is (the current folder on the path;
    a user's own module travels to the workers by value)."""
    return _import(target, flag)


def _import(target: str, flag: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise InputValueError(f"{flag} {target!r}: write package.module:function, e.g. mytrain.jobs:make_job")
    _search_path()  # like `python -m`: the current folder's modules import
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputValueError(
            f"{flag} {target!r}: cannot import {module_name!r} ({exc}); run from the folder that holds it "
            "or install its package"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputValueError(f"{flag} {target!r}: module {module_name!r} has no function {attr!r}")
    _ship_by_value(module)
    return fn


def _ship_by_value(module: Any) -> None:
    """A user's own module (not an installed package) travels to the workers with the job, so a
    single-file job runs on other machines without copying the file there."""
    path = getattr(module, "__file__", None)
    if path is None or module.__name__.startswith("mixtrain."):
        return
    installed = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
    if any(Path(path).resolve().is_relative_to(Path(p).resolve()) for p in installed):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)


def _call(fn: Callable[..., Any], target: str, given: dict[str, Any], args: dict[str, Any], flag: str) -> Any:
    """fn(**args, **given), with the arguments checked against fn's signature first: they are values (from a TOML
    config, or a resumed folder's command.json) for a job function written in Python, never a way to hand a
    command to some other callable (`os:system` is not a job function)."""
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise InputValueError(
            f"{flag} {target!r} is a {type(fn).__name__}, not a job function: give a Python function that returns "
            "mixtrain.Job, e.g. mytrain.jobs:make_job"
        )
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name, value in args.items():
        if name not in params and not takes_any:
            raise InputValueError(f"[args] {name} = {value!r}: {target} takes no argument {name!r}")
        _check_value(params.get(name), name, value, target)
    kwargs = dict(args)
    for name, value in given.items():
        if name in params or takes_any:
            kwargs[name] = value
        elif name != "seed":  # the seed also seeds the workers; a job need not take it
            raise InputValueError(f"--{name.replace('_', '-')} {value!r}: {target} takes no {name!r} argument")
    return fn(**kwargs)


_PLAIN = (bool, int, float, str)


def _check_value(param: inspect.Parameter | None, name: str, value: Any, target: str) -> None:
    """A TOML/JSON value for a keyword parameter: positional-only ones cannot take it, and one whose default is a
    plain value (a number, a string, a flag) takes a value of that kind only (an int where a float is wanted)."""
    if param is None:
        return
    if param.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
        raise InputValueError(f"[args] {name} = {value!r}: {target} takes {name!r} by position only, not by name")
    default = param.default
    if not isinstance(default, _PLAIN) or value is None:
        return
    kind = type(default)
    ok = isinstance(value, kind) and (kind is bool) == isinstance(value, bool)
    ok = ok or (kind is float and isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise InputValueError(
            f"[args] {name} = {value!r}: {target} takes a {kind.__name__} there (its default is {default!r})"
        )
