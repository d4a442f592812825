"""User-facing configuration: keyword-only dataclasses that check themselves."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, replace
from typing import Any, Literal, cast, get_args

from mixtrain import _checks as check
from mixtrain._constants import SLOWDOWN_ENV
from mixtrain.errors import InputTypeError, InputValueError

Precision = Literal["fp32", "auto", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
"""fp32 (exact), auto (bf16/fp16 autocast on GPUs, fp32 on CPUs), or one low precision everywhere
(devices/precision.py maps a request to each device). Here, not there: the configs import no torch."""
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_PLACEMENT_STRATEGIES: tuple[str, ...] = get_args(PlacementStrategy)
DeviceKind = Literal["cpu", "gpu", "cuda", "mps"]
_DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
Backend = Literal["auto", "gloo", "nccl"]
BACKENDS: tuple[str, ...] = get_args(Backend)
Shard = Literal["none", "optimizer", "gradients", "full", "auto"]
SHARDS: tuple[str, ...] = get_args(Shard)
NumericsCheck = Literal["warn", "strict", "off"]
NUMERICS_CHECKS: tuple[str, ...] = get_args(NumericsCheck)
MAX_SEED = 2**32 - 1
"""The largest seed: NumPy's and scikit-learn's generators take at most 32 bits."""


def _check_resources(name: str, value: object) -> None:
    """Ray resources per worker: a mapping of resource names to amounts >= 0, or None."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise InputTypeError(f"{name}={value!r}: give a dict of Ray resources, e.g. {{'CPU': 2, 'GPU': 0.5}}, or None")
    for key, amount in value.items():
        check.text(f"{name} key", key)
        check.number(f"{name}[{key!r}]", amount, 0)


Slowdown = dict[int, tuple[float, int]]
"""rank -> (factor, first round it applies to)."""


def parse_slowdown(text: str) -> Slowdown:
    """'1:3,2:1.5@4' -> {1: (3.0, 0), 2: (1.5, 4)}: worker 2 turns slow from round 4 on."""
    out: Slowdown = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, sep, rest = item.partition(":")
        factor, _, start = rest.partition("@")
        try:
            if not sep:
                raise ValueError
            out[int(rank)] = (float(factor), int(start or 0))
        except ValueError:
            raise InputValueError(
                f"{SLOWDOWN_ENV} item {item!r}: use RANK:FACTOR[@ROUND][,...], e.g. 1:3 or 1:3@5"
            ) from None
    return out


@dataclass(frozen=True, kw_only=True)
class DeviceGroup:
    """Workers of one kind, with Ray Train's per-worker knobs and their meaning.

    DeviceGroup(device="cuda", num_workers=1), DeviceGroup(device="mps"),
    DeviceGroup(device="cpu", num_workers=2, resources_per_worker={"CPU": 4}).
    """

    device: DeviceKind = "cpu"
    """"cpu", "cuda", "mps", or "gpu" (any GPU: CUDA or Apple, resolved on the node it lands on)."""
    num_workers: int = 1
    resources_per_worker: Mapping[str, float] | None = None
    """Ray resources per worker, e.g. {"CPU": 2, "GPU": 0.5} (fractional GPUs share one card).
    Defaults: {"CPU": 1} and, for GPU kinds, {"GPU": 1}."""
    accelerator_type: str | None = None
    """Only nodes with this Ray accelerator type, e.g. "A100", "H100", "M2"."""
    node: str | None = None
    """Only this node (its Ray node id); `auto` fills it in."""
    precision: Precision | None = None
    """This group's precision; None takes ScalingConfig.precision."""
    memory: str | int | None = None
    """Memory each of its workers may hold ("10GB", "1.25GB", "512MB", or bytes): sliced state
    (ScalingConfig.shard) is sized by it instead of by the free memory measured on the device. Give it for
    every group or none."""

    def __post_init__(self) -> None:
        check.choice("DeviceGroup.device", self.device, _DEVICE_KINDS)
        if self.memory is not None:
            self.memory_bytes()
        check.integer("DeviceGroup.num_workers", self.num_workers, 1)
        if self.precision is not None and self.precision not in PRECISIONS:
            raise InputValueError(
                f"DeviceGroup.precision={self.precision!r}: use one of {', '.join(PRECISIONS)} or None"
            )
        _check_resources("DeviceGroup.resources_per_worker", self.resources_per_worker)
        check.text("DeviceGroup.accelerator_type", self.accelerator_type, none=True)
        check.text("DeviceGroup.node", self.node, none=True)
        res = dict(self.resources_per_worker or {})
        if self.device == "cpu" and res.get("GPU", 0) > 0:
            raise InputValueError(
                f"DeviceGroup(device='cpu').resources_per_worker={res}: a CPU worker cannot hold a GPU; "
                "use device='gpu' (or 'cuda'/'mps')"
            )

    @property
    def uses_gpu(self) -> bool:
        return self.device != "cpu"

    def memory_bytes(self) -> int | None:
        """`memory` in bytes (None: not given)."""
        if self.memory is None:
            return None
        if isinstance(self.memory, int) and not isinstance(self.memory, bool):
            if self.memory <= 0:
                raise InputValueError(f"DeviceGroup.memory={self.memory!r}: give bytes > 0, or a size such as '10GB'")
            return self.memory
        if not isinstance(self.memory, str):
            raise InputTypeError(f"DeviceGroup.memory={self.memory!r}: give a size such as '10GB' or '512MB', or bytes")
        from mixtrain.policies.memory_plan import parse_bytes  # (no torch, no Ray)

        return parse_bytes(self.memory, f"DeviceGroup.memory={self.memory!r}")

    def resources(self) -> dict[str, float]:
        """The Ray resources one worker of this group reserves."""
        res = {"CPU": 1.0, **({"GPU": 1.0} if self.uses_gpu else {})}
        res.update({k: float(v) for k, v in (self.resources_per_worker or {}).items()})
        return res


def parse_workers(text: str) -> int | str | list[DeviceGroup]:
    """CLI --workers: "2" (CPU workers), "auto", or groups such as "cuda:1,mps:1,cpu:2"."""
    text = text.strip()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    groups = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, count = item.partition(":")
        if kind not in _DEVICE_KINDS or not (count or "1").isdigit() or int(count or "1") < 1:
            raise InputValueError(
                f"--workers {text!r}: item {item!r} is not KIND[:COUNT]; use a number, auto, or groups such as "
                f"cuda:1,mps:1,cpu:2 (kinds: {', '.join(_DEVICE_KINDS)})"
            )
        groups.append(DeviceGroup(device=cast(DeviceKind, kind), num_workers=int(count or "1")))
    if not groups:
        raise InputValueError(f"--workers {text!r}: use a number, auto, or groups such as cuda:1,mps:1,cpu:2")
    return groups


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Where the workers run and how the global batch is split between them. A training loop (mixtrain.train)
    honours every field but precision, numerics_check/numerics_tolerance, max_micro_batch and shard_optimizer, which
    it refuses when set (mixtrain/train/_settings.py)."""

    num_workers: int = None  # type: ignore[assignment]  # set in __post_init__: always an int afterwards
    """Number of workers; each holds one replica of the model. Ignored when `groups` is given. Unset (the
    default), with no `use_gpu`, `resources_per_worker` or `groups`: `groups="auto"`, the hardware there is (one
    worker per GPU, and on a node without one a single CPU worker holding every core, which beats two that
    share them); unset with those: 1, as in Ray Train."""
    cpus_per_worker: float = 1.0
    """Ray CPU resource reserved per worker (fractions allowed, as in Ray Train)."""
    use_gpu: bool = False
    """As in Ray Train: each worker takes one GPU (CUDA or Apple, resolved where it lands)."""
    resources_per_worker: Mapping[str, float] | None = None
    """As in Ray Train, e.g. {"CPU": 2, "GPU": 0.5}; overrides cpus_per_worker."""
    accelerator_type: str | None = None
    """As in Ray Train: only nodes with this accelerator type (e.g. "A100", "M2")."""
    groups: Sequence[DeviceGroup] | Literal["auto"] | None = None
    """Mixed devices: a list of DeviceGroup, or "auto" (one worker per GPU in the cluster, one CPU worker
    per node without a GPU). None: one group from num_workers/use_gpu/resources_per_worker."""
    precision: Precision = "fp32"
    """"fp32" (default, exact), "auto" (bf16/fp16 autocast on GPUs, fp32 on CPUs), "bf16" or "fp16"."""
    backend: Backend = "auto"
    """Collectives: "auto" (NCCL when every worker is CUDA, else gloo through CPU buffers), "gloo" or "nccl"."""
    network_interface: str | None = None
    """Interface the collectives use on every node (sets GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME);
    None: the interface that holds each node's Ray address."""
    numerics_check: NumericsCheck = "warn"
    """At start, each device's gradient on a small batch is compared with the CPU's: "warn" reports
    devices that disagree, "strict" also leaves them out, "off" skips the check."""
    numerics_tolerance: float | None = None
    """Relative L2 difference allowed by the numerics check; None: 1e-3 fp32, 2e-2 fp16, 6e-2 bf16."""
    threads_per_worker: int | None = None
    """torch intra-op threads per worker; None means max(1, int(cpus_per_worker))."""
    shares: Sequence[int] | Literal["auto", "equal"] = "auto"
    """"auto": start equal, then follow measured speed; "equal": fixed equal split; or fixed samples per worker."""
    max_micro_batch: Sequence[int | None] | None = None
    """Per worker, the largest micro-batch that fits in memory; a larger share is split (gradient accumulation).
    None: measured on each GPU at start (a search that survives out-of-memory); no limit on CPUs."""
    leave_out_slow: bool = True
    """With shares="auto": leave out a worker the job is predicted at least 30% faster without
    (MIXTRAIN_EXCLUDE_GAIN), e.g. a slow device on a small model whose communication costs more than
    it adds; the start-of-run table says why. False keeps every worker."""
    emulate_slowdown: Mapping[int, float | tuple[float, int]] | None = None
    """EMULATION for tests and benchmarks: rank -> factor (or (factor, from_round)), that worker computes
    `factor` times slower. Also read from MIXTRAIN_EMULATE_SLOWDOWN=RANK:FACTOR[@ROUND][,...]. Off by default."""
    shard: Shard = "none"
    """How much of the training state is sliced across the workers, by memory (the compute shares still follow
    speed): "none" (every worker holds everything), "optimizer" (ZeRO-1: each keeps the optimizer state of its
    slice of the parameters, steps it and sends it to the others), "gradients" (ZeRO-2: also each gradient only
    on its owner), "full" (ZeRO-3: also the weights; a block's weights are gathered just before its forward and
    its backward and freed after), or "auto" (at start-up, the lowest of those levels whose training state fits
    every worker's memory: each group's DeviceGroup.memory, else each device's free memory; the run says which and
    why, and refuses to start where none fits). The same math as one process at every level. Needs strategy
    "allreduce"."""
    shard_slices: Sequence[float] | None = None
    """Relative slice sizes, one per worker (e.g. [3, 1, 2]); None: each device's free memory."""
    offload: Literal["none", "optimizer"] = "none"
    """"optimizer": each worker's slice of the optimizer state, with an fp32 master copy of its weights, lives in
    host memory and is stepped there, so a GPU holds weights, gradients and activations only (ZeRO-Offload).
    Needs shard="optimizer", "gradients" or "full" (one worker with shard="optimizer" slices nothing)."""
    shard_optimizer: bool | Sequence[float] = False
    """DEPRECATED: use shard="optimizer" (True), with shard_slices=[...] for a list."""
    placement_strategy: PlacementStrategy = "PACK"
    """Ray placement group strategy for the workers' bundles."""
    address: str | None = None
    """Ray cluster to connect to ("auto", "ray://...", "host:port"); None starts an embedded local Ray."""
    keep_workers: bool | None = None
    """Keep the workers (started processes, reserved resources) when a fit ends cleanly, for the next fit in
    this process that asks for the same workers: seconds saved per fit in a notebook or a sweep.
    `mixtrain.release_workers()` frees them. None: MIXTRAIN_KEEP_WORKERS=1 turns it on; off by default."""

    def __post_init__(self) -> None:
        self._take_shard_optimizer()
        if self.num_workers is None:
            if self.groups is None and not self.use_gpu and self.resources_per_worker is None:
                object.__setattr__(self, "groups", "auto")
            object.__setattr__(self, "num_workers", 1)  # with "auto": until the cluster's groups replace it
        self._check_groups()
        if not self.is_auto and self.groups is not None:
            self.memory_caps()  # all groups or none
        if self.keep_workers not in (None, True, False):
            raise InputValueError(f"ScalingConfig.keep_workers={self.keep_workers!r}: use True, False or None")
        for name, value, allowed in (
            ("backend", self.backend, BACKENDS),
            ("numerics_check", self.numerics_check, NUMERICS_CHECKS),
            ("precision", self.precision, PRECISIONS),
        ):
            check.choice(f"ScalingConfig.{name}", value, allowed)
        check.integer("ScalingConfig.num_workers", self.num_workers, 1)
        check.number("ScalingConfig.numerics_tolerance", self.numerics_tolerance, 0, above=True, none=True)
        check.number("ScalingConfig.cpus_per_worker", self.cpus_per_worker, 0, above=True)
        check.boolean("ScalingConfig.use_gpu", self.use_gpu)
        check.boolean("ScalingConfig.leave_out_slow", self.leave_out_slow)
        _check_resources("ScalingConfig.resources_per_worker", self.resources_per_worker)
        for name in ("accelerator_type", "network_interface", "address"):
            check.text(f"ScalingConfig.{name}", getattr(self, name), none=True)
        check.integer("ScalingConfig.threads_per_worker", self.threads_per_worker, 1, none=True)
        check.choice("ScalingConfig.placement_strategy", self.placement_strategy, _PLACEMENT_STRATEGIES)
        if self.emulate_slowdown is not None and not isinstance(self.emulate_slowdown, Mapping):
            raise InputTypeError(
                f"ScalingConfig.emulate_slowdown={self.emulate_slowdown!r}: give {{rank: factor}} "
                "(e.g. {1: 3.0}) or None"
            )
        if self.is_auto:  # the worker count comes from the cluster; resolved() checks the per-worker lists
            if isinstance(self.shares, str):
                self._check_shares()
            return
        self._check_shares()
        self._check_per_worker()

    def _take_shard_optimizer(self) -> None:
        """The deprecated shard_optimizer=True / [sizes] becomes shard="optimizer" (with shard_slices)."""
        check.choice("ScalingConfig.shard", self.shard, SHARDS)
        check.choice("ScalingConfig.offload", self.offload, ("none", "optimizer"))
        old = self.shard_optimizer
        if old is False:
            return
        warnings.warn(
            "ScalingConfig.shard_optimizer is deprecated: use shard='optimizer' (and shard_slices=[...] for sizes)",
            DeprecationWarning,
            stacklevel=4,
        )
        if self.shard not in ("none", "optimizer"):
            raise InputValueError(f"ScalingConfig.shard_optimizer={old!r} with shard={self.shard!r}: give shard alone")
        object.__setattr__(self, "shard", "optimizer")
        if not isinstance(old, bool):
            object.__setattr__(self, "shard_slices", old)
        object.__setattr__(self, "shard_optimizer", False)

    def _check_groups(self) -> None:
        """groups: 'auto' or DeviceGroups, whose sizes give num_workers."""
        if isinstance(self.groups, str) and self.groups != "auto":
            raise InputValueError(f"ScalingConfig.groups={self.groups!r}: use 'auto' or a list of DeviceGroup")
        if self.groups is not None and not isinstance(self.groups, str):
            if not isinstance(self.groups, (list, tuple)):
                raise InputTypeError(f"ScalingConfig.groups={self.groups!r}: give a list of mixtrain.DeviceGroup")
            groups = list(self.groups)
            if not groups or not all(isinstance(g, DeviceGroup) for g in groups):
                raise InputValueError(f"ScalingConfig.groups={groups!r}: give a non-empty list of mixtrain.DeviceGroup")
            object.__setattr__(self, "num_workers", sum(g.num_workers for g in groups))

    def _check_shares(self) -> None:
        """shares: 'auto', 'equal' or one integer >= 1 per worker."""
        if isinstance(self.shares, str):
            if self.shares not in ("auto", "equal"):
                raise InputValueError(
                    f"ScalingConfig.shares={self.shares!r}: use 'auto', 'equal' or a list of integers, one per worker"
                )
        elif not isinstance(self.shares, (list, tuple)):
            raise InputTypeError(
                f"ScalingConfig.shares={self.shares!r}: use 'auto', 'equal' or a list of integers, one per worker"
            )
        else:
            shares = list(self.shares)
            if len(shares) != self.num_workers:
                raise InputValueError(
                    f"ScalingConfig.shares={shares}: has {len(shares)} entries but num_workers={self.num_workers}; "
                    "give one share per worker"
                )
            if any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in shares):
                raise InputValueError(f"ScalingConfig.shares={shares}: every share must be an integer >= 1")

    def _check_per_worker(self) -> None:
        """max_micro_batch and the emulated slowdown: one entry per worker, in range."""
        shard = self.shard_slices
        if shard is not None and (
            not isinstance(shard, (list, tuple))
            or len(shard) != self.num_workers
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in shard)
            or any(not w >= 0 for w in shard)
            or not sum(shard) > 0
        ):
            raise InputValueError(
                f"ScalingConfig.shard_slices={shard!r}: use None (slices sized by free memory), or one "
                f"relative size >= 0 per worker ({self.num_workers}) with a positive sum"
            )
        micro = self.max_micro_batch
        if micro is not None and (
            not isinstance(micro, (list, tuple))
            or len(micro) != self.num_workers
            or any(c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1) for c in micro)
        ):
            raise InputValueError(
                f"ScalingConfig.max_micro_batch={micro!r}: give one integer >= 1 (or None) per worker"
            )
        for rank, (factor, start) in self.slowdown().items():
            if not 0 <= rank < self.num_workers or not 1 <= factor < math.inf or start < 0:
                raise InputValueError(
                    f"emulated slowdown {rank}:{factor} (ScalingConfig.emulate_slowdown or MIXTRAIN_EMULATE_SLOWDOWN): "
                    f"use RANK:FACTOR with 0 <= RANK < {self.num_workers} and FACTOR >= 1, e.g. 1:3"
                )

    @property
    def is_auto(self) -> bool:
        return self.groups == "auto"

    def memory_caps(self) -> list[int] | None:
        """Per starting rank, the memory its group gives (DeviceGroup.memory), or None where no group gives one."""
        if self.is_auto or self.groups is None:
            return None
        groups = self.device_groups()
        caps = [g.memory_bytes() for g in groups]
        if all(c is None for c in caps):
            return None
        if any(c is None for c in caps):
            raise InputValueError(
                "DeviceGroup.memory is given for some groups only: give it for every group (slices are sized by "
                "it), or for none (by each device's free memory)"
            )
        return [int(c) for g, c in zip(groups, caps) for _ in range(g.num_workers) if c is not None]

    def device_groups(self) -> list[DeviceGroup]:
        """The groups of a resolved config (not "auto")."""
        assert not self.is_auto, "resolve groups='auto' against the cluster first (placement.resolve_scaling)"
        if self.groups is not None:
            return list(self.groups)  # type: ignore[arg-type]
        res = {"CPU": self.cpus_per_worker, **(self.resources_per_worker or {})}
        return [
            DeviceGroup(
                device="gpu" if self.use_gpu else "cpu",
                num_workers=self.num_workers,
                resources_per_worker=res,
                accelerator_type=self.accelerator_type,
            )
        ]

    def threads_for(self, cpus: float) -> int:
        """torch intra-op threads for a worker that reserved `cpus` CPUs."""
        return self.threads_per_worker or max(1, int(cpus))

    @property
    def num_threads(self) -> int:
        return self.threads_for(self.cpus_per_worker)

    @property
    def balanced(self) -> bool:
        return self.shares == "auto"

    def slowdown(self) -> Slowdown:
        """The emulated slowdown per rank: the API value, else MIXTRAIN_EMULATE_SLOWDOWN."""
        if self.emulate_slowdown is None:
            return parse_slowdown(os.environ.get(SLOWDOWN_ENV, ""))
        out: Slowdown = {}
        for rank, value in self.emulate_slowdown.items():
            factor, start = value if isinstance(value, tuple) and len(value) == 2 else (value, 0)
            number = (int, float)
            if not (isinstance(rank, int) and isinstance(factor, number) and isinstance(start, int)):
                raise InputValueError(
                    f"ScalingConfig.emulate_slowdown={dict(self.emulate_slowdown)!r}: give {{rank: factor}} or "
                    "{rank: (factor, from_round)} with integer ranks and rounds, e.g. {1: 3.0}"
                )
            out[rank] = (float(factor), start)
        return out


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run writes its files and how its rounds are paced."""

    name: str | None = None
    """Run name; the run folder is storage_path/name. None uses a timestamp."""
    storage_path: str = "mixtrain_runs"
    """Folder that holds one sub-folder per run (the loop door's and Ray Train's name)."""
    storage_dir: str | None = None
    """Deprecated: storage_path's old name (a DeprecationWarning; it becomes storage_path)."""
    run_dir: str | None = None
    """Exact run folder; overrides storage_path/name."""
    seed: int = 0
    """Seeds the model initialisation and the per-epoch sample permutation."""
    steps_per_round: int | None = None
    """Steps each worker runs per driver call; None sizes rounds to about 1.5 s (MIXTRAIN_ROUND_TARGET_S)."""
    drift_tolerance: float = 1e-6
    """Relative parameter-checksum difference above which rank 0's weights are re-broadcast."""
    progress: bool = True
    """Show live progress on the terminal."""
    plan_tables: bool = False
    """Print the whole plan table at every re-plan; by default the start-up plan is a table and each change of
    the plan one line (the tables are in metrics.jsonl and `mixtrain report` either way)."""
    checkpoint_every_s: float = 60.0
    """Write a checkpoint after the first round that ends this long after the last one, and at the end of the
    last epoch and of every epoch followed by an evaluation; 0 checkpoints after every round."""
    keep_checkpoints: int = 3
    """Checkpoints kept in run_dir/checkpoints (the newest); older ones are deleted."""
    max_failures: int = 3
    """Lost workers (or failed collectives) survived within any hour (MIXTRAIN_FAILURE_WINDOW_S) before training
    stops: a laptop whose Wi-Fi stalls now and then does not end a long run. Each costs at most the steps of
    the round in flight that no survivor committed."""
    rejoin: bool = True
    """Start a replacement where a worker was lost (a node that comes back, a restarted process); it
    joins at a round boundary with the current state."""
    max_nonfinite_steps: int = 10
    """Stop after this many steps in a row whose gradient was NaN/Inf (skipped on every worker)."""
    tensorboard: bool | None = None
    """TensorBoard event files in run_dir/tensorboard: None writes them when tensorboardX (or tensorboard)
    is installed, True requires it, False writes none."""
    max_steps: int | None = None
    """Stop after this many global steps (optimizer steps of the global batch, counted from the run's start):
    overrides fit(epochs=...), and the run may end inside an epoch (with a checkpoint and an evaluation there)."""
    eval_every: int | None = None
    """Evaluate every this many global steps (and at the run's end) instead of at each epoch's end; each
    evaluation is followed by a checkpoint, so a resumed run keeps the same schedule."""
    keep_best: tuple[str, str] | None = None
    """(metric, "min" or "max"), e.g. ("loss", "min"): the checkpoint with the best held-out value is kept
    beside the newest ones (pruning never deletes it); Result.best_checkpoint names it. Needs eval data."""

    def __post_init__(self) -> None:
        check.text("RunConfig.name", self.name, none=True)
        if self.name is not None and (os.sep in self.name or self.name in (".", "..")):
            raise InputValueError(
                f"RunConfig.name={self.name!r}: a name, not a path; give a folder as RunConfig.run_dir instead"
            )
        self._take_storage_dir()
        check.text("RunConfig.storage_path", self.storage_path)
        check.text("RunConfig.run_dir", self.run_dir, none=True)
        check.integer("RunConfig.seed", self.seed, 0, MAX_SEED)
        check.integer("RunConfig.steps_per_round", self.steps_per_round, 1, none=True, hint="None: automatic")
        check.number("RunConfig.drift_tolerance", self.drift_tolerance, 0)
        check.number("RunConfig.checkpoint_every_s", self.checkpoint_every_s, 0, finite=False)
        check.integer("RunConfig.keep_checkpoints", self.keep_checkpoints, 1)
        check.integer("RunConfig.max_failures", self.max_failures, 0)
        check.integer("RunConfig.max_nonfinite_steps", self.max_nonfinite_steps, 1)
        check.boolean("RunConfig.progress", self.progress)
        check.boolean("RunConfig.rejoin", self.rejoin)
        check.boolean("RunConfig.tensorboard", self.tensorboard, none=True)
        check.integer("RunConfig.max_steps", self.max_steps, 1, none=True, hint="None: fit(epochs=...) decides")
        check.integer("RunConfig.eval_every", self.eval_every, 1, none=True, hint="None: at each epoch's end")
        _check_keep_best(self.keep_best)
        if self.keep_best is not None:  # a list from a TOML file or JSON: the same setting
            object.__setattr__(self, "keep_best", (self.keep_best[0], self.keep_best[1]))

    def _take_storage_dir(self) -> None:
        """The deprecated storage_dir= becomes storage_path (one name for both doors)."""
        old = self.storage_dir
        if old is None:
            return
        warnings.warn("RunConfig.storage_dir is deprecated: use storage_path", DeprecationWarning, stacklevel=4)
        check.text("RunConfig.storage_dir", old)
        if self.storage_path not in ("mixtrain_runs", old):
            raise InputValueError(f"RunConfig.storage_dir={old!r} with storage_path={self.storage_path!r}: give one")
        object.__setattr__(self, "storage_path", old)
        object.__setattr__(self, "storage_dir", None)


def _check_keep_best(value: Any) -> None:
    if value is None:
        return
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str) and value[0]
    if not ok or value[1] not in ("min", "max"):
        raise InputValueError(
            f"RunConfig.keep_best={value!r}: give (metric, mode), e.g. ('loss', 'min') or ('accuracy', 'max') "
            "(--keep-best loss:min), or None"
        )


StrategyName = Literal["allreduce", "ps", "ps-async", "local-sgd", "auto"]
STRATEGY_NAMES: tuple[str, ...] = get_args(StrategyName)
OVERLAP_EXCHANGES_PER_ROUND = 4
"""Overlapped local SGD: rounds hold at least this many exchanges; the last of each round blocks (replicas are
equal at every round boundary), the others run while the next H steps compute."""

"""Compressions for local SGD's deltas only: quantized with a scale per block and error feedback."""
Compression = Literal["none", "bf16", "fp16", "int8", "int4"]
COMPRESSION: tuple[str, ...] = get_args(Compression)
QUANTIZED: tuple[Compression, ...] = ("int8", "int4")
Pace = Literal["balanced", "per-device"]
PACES: tuple[str, ...] = get_args(Pace)
"""Local SGD on unequal devices: the same inner steps per worker on batches sized by speed, or the same inner
batch per worker and steps sized by speed."""


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    """The parameter servers of strategies `ps` and `ps-async`: StrategyConfig(name="ps", ps=PSConfig(shards=2))."""

    shards: int | str = "auto"
    """Parameter-server actors the parameters are split over, by size; "auto": one per 16 MB, at most 4."""
    node: str | None = None
    """The Ray node id for the parameter servers; None: the driver's node (the head)."""
    staleness: int = 2
    """ps-async: how many updates a worker may run ahead of the newest weights it has (0: synchronous)."""

    def __post_init__(self) -> None:
        if self.shards != "auto" and not (
            isinstance(self.shards, int) and not isinstance(self.shards, bool) and self.shards >= 1
        ):
            raise InputValueError(f"PSConfig.shards={self.shards!r} (--ps-shards): use 'auto' or an integer >= 1")
        check.text("PSConfig.node", self.node, none=True)
        check.integer("PSConfig.staleness", self.staleness, 0, hint="0: synchronous")


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig:
    """Strategy `local-sgd` (and `auto`, when it picks local SGD):
    StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=16, overlap=True))."""

    local_steps: int = 8
    """Steps between averages (H); communication drops H-fold."""
    outer_lr: float = 1.0
    """Learning rate of the outer optimizer applied to the averaged delta. 1.0 with no momentum is plain
    averaging; DiLoCo uses 0.7 with momentum 0.9 at H in the hundreds, which at H=16 ended 16% worse in held-out
    loss on the slow-link benchmark (docs/benchmarks.md, strategies)."""
    outer_momentum: float = 0.0
    """Nesterov momentum of the outer optimizer (DiLoCo: 0.9; 0: none)."""
    overlap: bool = False
    """Exchange in the background while the next H steps compute, and apply the average one exchange late
    (Streaming DiLoCo's delayed outer update): a slow link costs up to H steps of compute less per exchange.
    Rounds then hold at least OVERLAP_EXCHANGES_PER_ROUND exchanges (a round ends in a blocking one). With
    `auto`: overlap if local SGD is chosen."""
    pace: Pace = "balanced"
    """With unequal devices: "balanced" (each step's samples are split by speed, so every worker takes the same H
    inner steps per window, the slower ones on smaller batches) or "per-device" (every worker's inner batch is the
    global batch over the number of workers, so a faster device, holding more of the samples, takes more inner
    steps per window; deltas are weighted by samples either way)."""

    def __post_init__(self) -> None:
        check.integer("LocalSGDConfig.local_steps", self.local_steps, 1)
        check.number("LocalSGDConfig.outer_lr", self.outer_lr, 0, above=True)
        check.number("LocalSGDConfig.outer_momentum", self.outer_momentum, 0, below=1)
        check.boolean("LocalSGDConfig.overlap", self.overlap)
        if self.pace not in PACES:
            raise InputValueError(f"LocalSGDConfig.pace={self.pace!r} (--pace): use one of {', '.join(PACES)}")


_MOVED: dict[str, tuple[str, str]] = {
    "staleness": ("ps", "staleness"),
    "ps_shards": ("ps", "shards"),
    "ps_node": ("ps", "node"),
    "local_steps": ("local_sgd", "local_steps"),
    "outer_lr": ("local_sgd", "outer_lr"),
    "outer_momentum": ("local_sgd", "outer_momentum"),
    "overlap": ("local_sgd", "overlap"),
    "pace": ("local_sgd", "pace"),
}
"""StrategyConfig's deprecated flat keywords -> (section, field there). Removed in the next version."""
_SECTIONS: dict[str, type] = {"ps": PSConfig, "local_sgd": LocalSGDConfig}


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """How replicas agree on an update. `allreduce` (the default) sums gradients over gloo every step;
    `ps` sends them to parameter-server actors that hold the weights and the optimizer (the same math);
    `ps-async` lets a worker run up to `ps.staleness` updates ahead of the slowest; `local-sgd` takes
    `local_sgd.local_steps` steps on each worker, then averages the parameter deltas and applies them with an
    outer Nesterov-momentum optimizer (DiLoCo); `auto` measures one all-reduce against a step's compute at
    start-up and adopts what the figures call for: all-reduce, or local SGD with the H (and past H=64 the
    int8/int4 deltas) that keep communication under 10% of compute.

    Each strategy's own settings are a section: StrategyConfig(name="ps", ps=PSConfig(shards=2)),
    StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=16)). The flat keywords of before
    (staleness=, local_steps=, outer_lr=, outer_momentum=, overlap=, pace=, ps_shards=, ps_node=) still work,
    with a DeprecationWarning, until the next version; they are read from the sections only."""

    name: StrategyName = "allreduce"
    compress: Compression = "none"
    """What gradients (allreduce, ps) or deltas (local-sgd) travel as: none (fp32), bf16 or fp16; local-sgd
    also int8 or int4 (a scale per 256 values, error feedback: what rounding drops is sent with the next)."""
    ps: PSConfig = PSConfig()
    """ps, ps-async: the parameter servers (shards, node) and ps-async's staleness."""
    local_sgd: LocalSGDConfig = LocalSGDConfig()
    """local-sgd (and auto): H, the outer optimizer, overlap and pace."""
    staleness: InitVar[int | None] = None
    """Deprecated: ps=PSConfig(staleness=...)."""
    local_steps: InitVar[int | None] = None
    """Deprecated: local_sgd=LocalSGDConfig(local_steps=...)."""
    outer_lr: InitVar[float | None] = None
    """Deprecated: local_sgd=LocalSGDConfig(outer_lr=...)."""
    outer_momentum: InitVar[float | None] = None
    """Deprecated: local_sgd=LocalSGDConfig(outer_momentum=...)."""
    overlap: InitVar[bool | None] = None
    """Deprecated: local_sgd=LocalSGDConfig(overlap=...)."""
    pace: InitVar[Pace | None] = None
    """Deprecated: local_sgd=LocalSGDConfig(pace=...)."""
    ps_shards: InitVar[int | str | None] = None
    """Deprecated: ps=PSConfig(shards=...)."""
    ps_node: InitVar[str | None] = None
    """Deprecated: ps=PSConfig(node=...)."""

    def __post_init__(
        self,
        staleness: int | None,
        local_steps: int | None,
        outer_lr: float | None,
        outer_momentum: float | None,
        overlap: bool | None,
        pace: Pace | None,
        ps_shards: int | str | None,
        ps_node: str | None,
    ) -> None:
        check.choice("strategy", self.name, STRATEGY_NAMES)
        check.choice("StrategyConfig.compress", self.compress, COMPRESSION)
        for section, cls in _SECTIONS.items():
            if not isinstance(getattr(self, section), cls):
                raise InputTypeError(
                    f"StrategyConfig.{section}={getattr(self, section)!r}: give a mixtrain.{cls.__name__}"
                )
        flat = dict(
            staleness=staleness,
            local_steps=local_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            overlap=overlap,
            pace=pace,
            ps_shards=ps_shards,
            ps_node=ps_node,
        )
        self._take_flat({k: v for k, v in flat.items() if v is not None})
        if self.compress in QUANTIZED and self.name != "local-sgd":
            raise InputValueError(
                f"StrategyConfig.compress={self.compress!r} (--compress {self.compress}) works with strategy "
                "local-sgd only (its deltas are quantized with error feedback; a gradient exchange every step is "
                f"not), not {self.name!r}: use compress='bf16' or 'fp16' here (--compress bf16), or "
                "strategy='local-sgd' (--strategy local-sgd)"
            )
        self._check_local_sgd()

    def _take_flat(self, given: dict[str, Any]) -> None:
        """The deprecated flat keywords move into their sections; a section that says otherwise is an error."""
        changes: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
        for old, value in given.items():
            section, new = _MOVED[old]
            cls = _SECTIONS[section]
            warnings.warn(
                f"StrategyConfig.{old} is deprecated: use StrategyConfig({section}={cls.__name__}({new}=...))",
                DeprecationWarning,
                stacklevel=4,
            )
            current = getattr(getattr(self, section), new)
            if current not in (getattr(cls(), new), value):
                raise InputValueError(
                    f"StrategyConfig.{old}={value!r} with {section}={cls.__name__}({new}={current!r}): give "
                    f"{section}={cls.__name__}({new}=...) alone"
                )
            changes[section][new] = value
        for section, fields in changes.items():
            if fields:
                object.__setattr__(self, section, replace(getattr(self, section), **fields))

    def _check_local_sgd(self) -> None:
        """local SGD's own options with another strategy: an error, not a setting silently ignored."""
        local_sgd = self.local_sgd
        if local_sgd.overlap and self.name not in ("local-sgd", "auto"):
            raise InputValueError(
                f"StrategyConfig.local_sgd.overlap=True (--overlap) works with strategy local-sgd (or auto, when it "
                f"picks local-sgd), not {self.name!r}: use strategy='local-sgd' (--strategy local-sgd --overlap)"
            )
        if local_sgd.pace != "balanced" and self.name not in ("local-sgd", "auto"):
            raise InputValueError(
                f"StrategyConfig.local_sgd.pace={local_sgd.pace!r} (--pace {local_sgd.pace}) works with strategy "
                f"local-sgd (or auto, when it picks local-sgd), not {self.name!r}: every other strategy takes one "
                "update per global batch"
            )

    @property
    def steps_per_exchange(self) -> int:
        """Steps between two exchanges over the link."""
        return self.local_sgd.local_steps if self.name == "local-sgd" else 1

    @property
    def min_round_steps(self) -> int:
        """The shortest round: overlapped local SGD needs several exchanges per round, as a round ends with a
        blocking one."""
        if self.name == "local-sgd" and self.local_sgd.overlap:
            return self.local_sgd.local_steps * OVERLAP_EXCHANGES_PER_ROUND
        return 1

    def as_allreduce(self) -> StrategyConfig:
        """These settings for all-reduce: local SGD's own options (overlap, pace) back to their defaults, and
        no int8/int4 gradients."""
        compress = "none" if self.compress in QUANTIZED else self.compress
        local_sgd = replace(self.local_sgd, overlap=False, pace="balanced")
        return replace(self, name="allreduce", compress=compress, local_sgd=local_sgd)

    def as_local_sgd(self, local_steps: int, compress: Compression | None = None) -> StrategyConfig:
        """These settings for overlapped local SGD with H=`local_steps` (and `compress` on the wire, if given):
        what `auto` adopts on a slow link."""
        local_sgd = replace(self.local_sgd, local_steps=local_steps, overlap=True)
        return replace(self, name="local-sgd", compress=compress or self.compress, local_sgd=local_sgd)

    def describe(self) -> str:
        local_sgd = self.local_sgd
        overlapped = ", overlapped" if local_sgd.overlap else ""
        overlapped += f", {local_sgd.pace} pace" if local_sgd.pace != "balanced" else ""
        extra = {
            "ps-async": f" (staleness {self.ps.staleness})",
            "local-sgd": f" (H={local_sgd.local_steps}{overlapped})",
        }
        wire = f", {self.compress} on the wire" if self.compress != "none" else ""
        return f"{self.name}{extra.get(self.name, '')}{wire}"


def check_together(scaling: ScalingConfig, strategy: StrategyConfig) -> None:
    """What the configs ask of each other (each checks itself on construction)."""
    if scaling.offload != "none" and scaling.shard == "none":
        raise InputValueError(
            f"ScalingConfig.offload={scaling.offload!r} with shard='none': the offloaded optimizer is a slice's; "
            "give shard='optimizer' (on one worker it slices nothing), 'gradients' or 'full'"
        )
    if scaling.shard != "none" and strategy.name != "allreduce":
        raise InputValueError(
            f"ScalingConfig.shard={scaling.shard!r} with strategy={strategy.name!r}: sliced state needs "
            "strategy='allreduce' (parameter servers already keep the optimizer off the workers; local SGD "
            "steps a whole optimizer on each worker)"
        )
