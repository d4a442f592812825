"""A torchrun-style script as a loop: `mixtrain run train.py -- ARGS` runs the script as __main__ on every worker,
the way torchrun starts it on every rank. The script's own `torch.distributed.init_process_group(...)` and
`destroy_process_group()` find mixtrain's group already formed and leave it be; RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE are set as torchrun sets them. The script is sent to the workers as text (its folder is put first
on the import path where it exists on that machine, so modules beside it import as they would)."""

from __future__ import annotations

import os
import runpy
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixtrain.errors import InputValueError


@dataclass(frozen=True)
class ScriptLoop:
    """The loop a script is: called on each worker with no config."""

    name: str
    """The script's file name, for tracebacks and messages."""
    folder: str
    source: str
    argv: tuple[str, ...] = ()

    @classmethod
    def from_file(cls, path: str | Path, argv: list[str]) -> ScriptLoop:
        file = Path(path)
        if not file.is_file():
            raise InputValueError(f"mixtrain run {str(path)!r}: no such script")
        return cls(file.name, str(file.resolve().parent), file.read_text(), tuple(argv))

    @property
    def __name__(self) -> str:  # the driver names the loop by it
        return self.name

    def __call__(self) -> None:
        from mixtrain.train import _session

        session = _session.current("a script")
        ctx = session.context
        env = {
            "RANK": str(ctx.world_rank),
            "WORLD_SIZE": str(ctx.world_size),
            "LOCAL_RANK": str(ctx.local_rank),
            "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
            "GROUP_RANK": str(ctx.node_rank),
        }
        with tempfile.TemporaryDirectory(prefix="mixtrain-script-") as tmp, _environ(env), _argv(self), _path(self):
            script = Path(tmp) / self.name
            script.write_text(self.source)
            with _group_kept():
                runpy.run_path(str(script), run_name="__main__")


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _argv(loop: ScriptLoop) -> Iterator[None]:
    saved = sys.argv
    sys.argv = [loop.name, *loop.argv]
    try:
        yield
    finally:
        sys.argv = saved


@contextmanager
def _path(loop: ScriptLoop) -> Iterator[None]:
    """The script's folder first on the import path, where it exists here (modules beside it import)."""
    added = Path(loop.folder).is_dir() and loop.folder not in sys.path
    if added:
        sys.path.insert(0, loop.folder)
    try:
        yield
    finally:
        if added:
            sys.path.remove(loop.folder)


@contextmanager
def _group_kept() -> Iterator[None]:
    """The script's init_process_group / destroy_process_group leave mixtrain's group as it is."""
    import torch.distributed as dist

    saved = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if not dist.is_initialized():
            saved[0](*args, **kwargs)

    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        pass  # mixtrain's worker leaves the group when the run ends

    dist.init_process_group, dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = saved
