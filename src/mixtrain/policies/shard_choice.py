"""ScalingConfig(shard="auto"): the lowest slicing level whose training state fits every worker's memory.

What a worker holds at a level is the what-if plan's rule (memory_plan.holding): weights, frozen weights,
gradients, optimizer state, the gathered block and the transients of that level. Activations are left out: the
micro-batch is sized to what is left (measured on GPUs at start-up). Each worker's memory is
- its group's DeviceGroup(memory=...): a budget for the whole worker process, whose own bytes count against it
  (memory_plan.PROCESS_BYTES), as in `mixtrain plan --devices cpu:1.25GB`; or
- the free memory its device had just before it built the model (the process's own bytes already spent there),
  split evenly among the workers that share the device (one host's CPU or MPS memory, one CUDA card); of the
  figures those workers measured, the largest (they build at once, so a later one sees the others' models).
The slices follow the memory (or ScalingConfig.shard_slices), as the engine's do.

Pure functions and dataclasses: no torch, no Ray. `resolve(scaling, shape, seen)` at bring-up;
`choose_shard(shape, workers)` is the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from mixtrain.errors import InputValueError
from mixtrain.policies.memory_plan import LEVELS, PROCESS_BYTES, UNIFIED, holding

if TYPE_CHECKING:
    from mixtrain.config import ScalingConfig, Shard
    from mixtrain.policies.model_shape import ModelShape

FROM_CAPS = "DeviceGroup.memory, less each process's own"
FROM_FREE = "free device memory at start, split among the workers sharing a device"


class Seen(NamedTuple):
    """What bring-up knows of one worker's device (its build report)."""

    rank: int
    """Its starting rank (ScalingConfig's per-worker lists are indexed by it)."""
    host: str
    kind: str
    device_id: str
    """The physical device's identity where there is one (CUDA's UUID), else ""."""
    free_memory: int | None


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's memory for the training state."""

    name: str
    """e.g. "worker 1"."""
    kind: str
    memory_bytes: int
    given: bool
    """True: a budget the user gave (DeviceGroup.memory), the process's own bytes included; False: free memory
    measured in the running process."""
    host: str = ""

    @property
    def label(self) -> str:
        """e.g. "worker 1 (cpu on node-a)"."""
        return f"{self.name} ({self.kind} on {self.host})" if self.host else self.name

    @property
    def room(self) -> float:
        """Bytes left for the training state."""
        return self.memory_bytes - (PROCESS_BYTES[self.kind] if self.given else 0)


@dataclass(frozen=True)
class LevelNeed:
    """What each worker would hold at one level (the state only: no process, no activations)."""

    level: str
    needs: tuple[float, ...]
    rooms: tuple[float, ...]

    @property
    def fits(self) -> bool:
        return all(n <= r for n, r in zip(self.needs, self.rooms, strict=True))

    @property
    def tightest(self) -> int:
        """The worker closest to (or furthest over) its memory."""
        return max(range(len(self.needs)), key=lambda r: self.needs[r] / max(self.rooms[r], 1.0))


@dataclass(frozen=True)
class ShardChoice:
    """The level picked, the relative slice sizes it assumed (one per worker) and why, in one line."""

    level: str
    slices: tuple[float, ...]
    tried: tuple[LevelNeed, ...]
    """Every level weighed, the picked one last."""
    line: str

    def record(self) -> dict[str, Any]:
        """For metrics.jsonl (the preflight record): the level, why, and each level's bytes per worker."""
        return {
            "requested": "auto",
            "level": self.level,
            "reason": self.line,
            "room_bytes": list(self.tried[0].rooms),
            "need_bytes": {t.level: list(t.needs) for t in self.tried},
        }


def worker_memories(seen: Sequence[Seen], caps: Sequence[int] | None) -> list[WorkerMemory]:
    """Each worker's memory: its cap (by starting rank) where caps are given, else its share of its device's
    free memory. A worker whose device cannot tell its free memory is refused, naming it."""
    keys = [_device_key(r, s) for r, s in enumerate(seen)]
    devices: dict[tuple[str, str, str], list[int]] = {}
    for key, s in zip(keys, seen, strict=True):
        devices.setdefault(key, []).append(s.free_memory or 0)
    out = []
    for r, (key, s) in enumerate(zip(keys, seen, strict=True)):
        name = f"worker {r}"
        if caps is not None:
            out.append(WorkerMemory(name, s.kind, int(caps[s.rank]), given=True, host=s.host))
            continue
        if not s.free_memory:
            raise InputValueError(
                f"ScalingConfig.shard='auto': {name} ({s.kind} on {s.host}) cannot tell its free memory; give each "
                "group's memory "
                "(DeviceGroup(memory='10GB')), or a level: 'none', 'optimizer', 'gradients' or 'full'"
            )
        shared = devices[key]
        out.append(WorkerMemory(name, s.kind, max(shared) // len(shared), given=False, host=s.host))
    return out


def _device_key(rank: int, seen: Seen) -> tuple[str, str, str]:
    """Workers with one key share one memory: a host's (CPU, MPS: unified), or one card's (by its identity; a card
    without one is taken as the worker's own)."""
    if seen.kind in UNIFIED:
        return (seen.host, seen.kind, "")
    return (seen.host, seen.kind, seen.device_id or f"worker {rank}")


def choose_shard(
    shape: ModelShape, workers: Sequence[WorkerMemory], *, offload: bool = False, slices: Sequence[float] | None = None
) -> ShardChoice:
    """The lowest level (none, optimizer, gradients, full; "none" skipped with `offload`, which needs a slice) at
    which every worker's state fits its room, the slices following `slices` or else the memory. Where none fits, an
    InputValueError names the level that comes nearest, its tightest worker, that worker's memory and the need,
    and the fixes."""
    sizes = tuple(float(s) for s in slices) if slices is not None else tuple(float(w.memory_bytes) for w in workers)
    tried: list[LevelNeed] = []
    for level in LEVELS[1:] if offload else LEVELS:
        tried.append(weigh(shape, level, workers, sizes, offload))
        if tried[-1].fits:
            return ShardChoice(level, sizes, tuple(tried), _line(tried, workers))
    nearest = min(tried, key=lambda t: t.needs[t.tightest] / max(t.rooms[t.tightest], 1.0))
    worst = workers[nearest.tightest]
    raise InputValueError(
        f"ScalingConfig.shard='auto': no level's training state fits every worker: the nearest, {nearest.level!r}, "
        f"needs {size(nearest.needs[nearest.tightest])} on {worst.label}, which has {size(worst.room)} for it "
        f"({FROM_CAPS if worst.given else FROM_FREE}); give the workers more memory, add workers to slice over, "
        "offload='optimizer' on GPUs, or train a smaller model (or give ScalingConfig.shard a level to start anyway)"
    )


def weigh(
    shape: ModelShape, level: str, workers: Sequence[WorkerMemory], sizes: Sequence[float], offload: bool = False
) -> LevelNeed:
    """What each worker's training state would be at `level`, sliced by the relative `sizes`: memory_plan.holding
    (the what-if plan's rule) at micro-batch 0, less the process's own bytes (a worker's room accounts for them)."""
    needs = []
    for w, s in zip(workers, sizes, strict=True):
        parts = holding(shape, level, offload, s / sum(sizes) if level != "none" else 1.0, 0, w.kind)
        needs.append(sum(v for k, v in parts.items() if k != "process"))
    return LevelNeed(level, tuple(needs), tuple(w.room for w in workers))


def _line(tried: Sequence[LevelNeed], workers: Sequence[WorkerMemory]) -> str:
    """shard auto: LEVEL, its tightest worker's need and memory, and each lower level's tightest need."""
    chosen, w = tried[-1], tried[-1].tightest
    fit = f"{workers[w].label} needs {size(chosen.needs[w])} of its {size(chosen.rooms[w])}, the tightest"
    lower = ", ".join(
        f"{t.level} needs {size(t.needs[t.tightest])} of {workers[t.tightest].name}'s {size(t.rooms[t.tightest])}"
        for t in tried[:-1]
    )
    source = FROM_CAPS if any(x.given for x in workers) else FROM_FREE
    return (
        f"shard auto: {chosen.level}, the lowest level whose training state fits every worker: {fit}"
        f"{'; lower levels do not: ' + lower if lower else ''} (memory: {source})"
    )


def resolve(scaling: ScalingConfig, shape: ModelShape, seen: Sequence[Seen]) -> tuple[ScalingConfig, ShardChoice]:
    """ScalingConfig(shard="auto") with the level chosen for these workers (by starting rank), and the choice.
    Where the slices follow measured free memory, those figures become shard_slices, so the engine slices as
    the choice assumed."""
    caps = scaling.memory_caps()
    workers = worker_memories(seen, caps)
    given = [scaling.shard_slices[s.rank] for s in seen] if scaling.shard_slices else None
    choice = choose_shard(shape, workers, offload=scaling.offload != "none", slices=given)
    slices = scaling.shard_slices
    if choice.level != "none" and slices is None and caps is None:
        by_rank = [0.0] * scaling.num_workers
        for s, w in zip(seen, workers, strict=True):
            by_rank[s.rank] = float(w.memory_bytes)
        slices = by_rank
    return replace(scaling, shard=cast("Shard", choice.level), shard_slices=slices), choice


def size(value: float) -> str:
    """Bytes as a person reads them: B, KiB, MiB or GiB, three digits or more, no exponent."""
    unit, scale = next(((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if value >= k), ("B", 1))
    v = value / scale
    return f"{v:.0f} {unit}" if v >= 100 or unit == "B" else f"{v:.{1 if v >= 10 else 2}f} {unit}"
