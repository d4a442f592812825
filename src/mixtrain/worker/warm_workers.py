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

from mixtrain._constants import KEEP_WORKERS_ENV
from mixtrain.errors import InputValueError

"""Default of ScalingConfig.keep_workers where it is left at None: "1" keeps, "0" (or unset) does not."""


def wanted(keep_workers: bool | None) -> bool:
    """ScalingConfig.keep_workers, with None read from MIXTRAIN_KEEP_WORKERS."""
    if keep_workers is not None:
        return keep_workers
    raw = os.environ.get(KEEP_WORKERS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise InputValueError(f"{KEEP_WORKERS_ENV}={raw!r}: set it to 1 (keep workers between fits) or 0 (do not)")
    return raw == "1"


@dataclass
class Idle:
    """One set of kept workers: what they were started for, their placement group and their actors."""

    key: tuple
    pg: Any
    actors: list[Any]
    fits: int = 1
    """How many fits these workers have served (KEEP_WORKERS_MAX_FITS bounds it)."""


_idle: Idle | None = None


def key_for(worker_cls: type, specs: list[Any], placement_strategy: str, network_interface: str | None) -> tuple:
    """What a set of workers was started for: equal keys mean the same actors in the same bundles would do."""
    context = ray.get_runtime_context()
    cluster = (context.gcs_address, context.get_node_id())  # this Ray, not a new one started on the same port
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


def _user_modules(seen_at_start: set[str]) -> dict[str, str]:
    """name -> source file of the modules loaded since the worker started from outside the installed packages
    (the user's own, next to their script); mixtrain itself never counts."""
    roots = _installed_roots()
    found = {}
    for name, module in list(sys.modules.items()):
        if name in seen_at_start or name == "mixtrain" or name.startswith("mixtrain."):
            continue
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py") and not os.path.realpath(path).startswith(roots):
            found[name] = path
    return found


def _stat(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def user_module_stats(seen_at_start: set[str]) -> dict[str, tuple[int, int] | None]:
    """The user's modules loaded now, each with its file's modification time and size (taken right after the task
    was built: what the next fit compares with to tell an edited file)."""
    return {name: _stat(path) for name, path in _user_modules(seen_at_start).items()}


def forget_edited_modules(seen_at_start: set[str], stats: dict[str, tuple[int, int] | None]) -> list[str]:
    """Drop from sys.modules the user's modules whose file changed since `stats` was taken, or that were loaded
    after it: the next fit imports them again, as a new worker would. Unchanged ones stay loaded (a module that
    registers something when imported, such as a Hugging Face config class, cannot always be imported twice).
    Installed packages and mixtrain itself always stay. Returns the names dropped."""
    dropped = []
    for name, path in _user_modules(seen_at_start).items():
        if name not in stats or _stat(path) != stats[name]:
            del sys.modules[name]
            dropped.append(name)
    return dropped


def torch_settings() -> dict[str, Any]:
    """The process-wide torch settings a user's task may change (a new process starts with these)."""
    return {
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "grad": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }


def restore_torch_settings(saved: dict[str, Any]) -> None:
    """Put back what torch_settings() recorded."""
    torch.set_default_dtype(saved["dtype"])
    if torch.get_default_device() != saved["device"]:  # (setting "cpu" itself would add a mode to every call)
        torch.set_default_device(None if saved["device"].type == "cpu" else saved["device"])
    torch.set_grad_enabled(saved["grad"])
    torch.set_anomaly_enabled(saved["anomaly"])
    torch.use_deterministic_algorithms(saved["deterministic"], warn_only=saved["deterministic_warn_only"])
    torch.set_float32_matmul_precision(saved["matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = saved["cuda_matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = saved["cudnn_tf32"]
    torch.backends.cudnn.benchmark = saved["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = saved["cudnn_deterministic"]


def reset_peak_rss() -> None:
    """Start this process's peak resident memory (VmHWM) again from what it holds now (Linux), so the next run's
    memory figures are its own."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the earlier runs too
