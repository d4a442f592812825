"""Warm workers: the actors of a finished fit, kept in their reserved bundles for the next one.

Starting a worker costs seconds: Ray reserves a bundle, starts a process, and that process imports
torch and mixtrain (about 1.8 s of CPU on a laptop core). A notebook or a sweep that calls `fit()`
again and again with the same workers pays that every time. With `ScalingConfig(keep_workers=True)`
(or MIXTRAIN_KEEP_WORKERS=1), a fit or plan that ends cleanly leaves its workers idle, outside any
process group, in this driver process's keeping. The next fit here that asks for the same workers
(the same bundles, devices, precision, threads, network interface and worker class, on the same Ray)
takes them: each resets itself (`TrainWorker.reuse`) and builds the new task as a new worker would.

At most one set is kept. A fit that asks for other workers frees it first, so idle workers never hold
resources that another fit needs; `release_workers()` frees it at once; the workers end with the
driver process in any case (they are not detached). A set that does not answer the reset is freed and
new workers start, so a kept worker that died meanwhile costs nothing but the start it was to save.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

KEEP_WORKERS_ENV = "MIXTRAIN_KEEP_WORKERS"
"""Default of ScalingConfig.keep_workers where it is left at None: "1" keeps, "0" (or unset) does not."""


def wanted(keep_workers: bool | None) -> bool:
    """ScalingConfig.keep_workers, with None read from MIXTRAIN_KEEP_WORKERS."""
    if keep_workers is not None:
        return keep_workers
    raw = os.environ.get(KEEP_WORKERS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{KEEP_WORKERS_ENV}={raw!r}: set it to 1 (keep workers between fits) or 0 (do not)")
    return raw == "1"


@dataclass
class Idle:
    """One set of kept workers: what they were started for, their placement group and their actors."""

    key: tuple
    pg: Any
    actors: list[Any]


_idle: Idle | None = None


def key_for(worker_cls: type, specs: list[Any], placement_strategy: str, network_interface: str | None) -> tuple:
    """What a set of workers was started for: equal keys mean the same actors in the same bundles would do."""
    cluster = ray.get_runtime_context().gcs_address
    return (cluster, worker_cls, tuple(specs), placement_strategy, network_interface)


def take(key: tuple) -> Idle | None:
    """The kept set if it was started for `key` (it is no longer kept); any other kept set is freed."""
    global _idle
    idle, _idle = _idle, None
    if idle is None:
        return None
    if idle.key == key:
        return idle
    free(idle)
    return None


def keep(idle: Idle) -> None:
    """Keep `idle` for the next fit, freeing the set kept before."""
    global _idle
    release_workers()
    _idle = idle


def free(idle: Idle) -> None:
    """Stop a set's actors and give back its bundles (a Ray that has shut down meanwhile has done both)."""
    try:
        for actor in idle.actors:
            ray.kill(actor)
        remove_placement_group(idle.pg)
    except Exception:  # the Ray these handles belonged to is gone: nothing is left to free
        pass


def release_workers() -> None:
    """Stop the workers kept by `ScalingConfig(keep_workers=True)` and free their resources now."""
    global _idle
    idle, _idle = _idle, None
    if idle is not None:
        free(idle)


def kept() -> int:
    """How many workers are kept now (0 or the size of the kept set)."""
    return len(_idle.actors) if _idle is not None else 0


# ---- the worker's side: what a kept worker undoes before its next fit ---------------------------
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"], sys.prefix, sys.base_prefix}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def forget_user_modules(seen_at_start: set[str]) -> list[str]:
    """Drop from sys.modules what the last fit imported from outside the installed packages (the user's own
    modules, next to their script): the next fit imports them again, so an edited model file is seen as a new
    worker would see it. Installed packages (torchvision, transformers) and mixtrain itself stay loaded, as do
    compiled extensions, which cannot be loaded twice. Returns the names dropped."""
    roots = _installed_roots()
    dropped = []
    for name, module in list(sys.modules.items()):
        if name in seen_at_start or name == "mixtrain" or name.startswith("mixtrain."):
            continue
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or os.path.realpath(path).startswith(roots):
            continue
        del sys.modules[name]
        dropped.append(name)
    return dropped


def fresh_torch_defaults() -> None:
    """Undo process-wide torch settings a user's task may have changed (a new process starts with these)."""
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) again from what it holds now (Linux), so the next run's
    memory figures are its own."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the earlier runs too
