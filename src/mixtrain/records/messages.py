"""Every message between the driver and its workers, typed: what a worker is, what it built, what it
measured, what the driver asks of a round and what each worker answers. Constructors of more than three
fields take keywords; `as_dict()` is the form metrics.jsonl and Result keep."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mixtrain.devices import DeviceInfo

if TYPE_CHECKING:
    from mixtrain.frozen_base import FrozenBase
    from mixtrain.policies.model_shape import ModelShape
    from mixtrain.pretrained import HFModelSpec


@dataclass(frozen=True, kw_only=True)
class WorkerSetup:
    """What a worker process starts with, and a kept one starts the next fit with (TrainWorker.reuse)."""

    rank: int
    world_size: int
    num_threads: int
    seed: int
    device_request: str = "cpu"
    precision_request: str = "fp32"
    log_to: tuple[str, str] | None = None
    """(the run's log folder, the driver's node id); see worker_log."""
    bundle: int = -1
    """Its placement-group bundle: the rank it started with, which stays when ranks renumber."""
    memory_cap: int | None = None
    """Bytes its DeviceGroup(memory=...) gives it; held on CUDA and MPS by the allocator (DeviceKind.cap_memory)."""


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    """Everything a worker needs to join the collective group and set its strategy up (TrainWorker.join)."""

    host: str
    """Rank 0's rendezvous address, and its port."""
    port: int
    prefix: str
    """This formation's random key prefix in the store: only who got it through Ray can write the keys it reads."""
    rendezvous_timeout_s: float
    collective_timeout_s: float
    strategy: Any
    """The StrategyConfig the group runs."""
    bucket_bytes: int
    backend: str = "gloo"
    loss_scaling: bool = False
    """One job-wide fp16 loss scale (some worker runs fp16)."""
    servers: tuple[Any, ...] = ()
    """The parameter-server actors (ps strategies)."""
    fresh_state: bool = True
    """The workers hold state the parameter servers have not seen yet (a first formation, a loaded state)."""
    shard_optimizer: tuple[float, ...] | None = None
    """None: not sharded; (): slices by each worker's free memory; else relative sizes per rank."""
    shard_level: str = "none"
    """ScalingConfig.shard: "optimizer" (all-reduce with a sliced optimizer), "gradients" or "full"."""
    offload: bool = False
    """ScalingConfig.offload="optimizer": the optimizer's slice steps in host memory."""
    store_pages_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """Who one worker is: node, process, device and precision."""

    rank: int
    host: str
    """The node's IP address."""
    hostname: str
    pid: int
    node_id: str
    device: str
    """The torch device, e.g. "cuda:0"."""
    device_name: str
    precision: str
    threads: int

    def label(self) -> str:
        """A name that stays the same when ranks renumber: "cuda:0 on desktop (pid 123)"."""
        return f"{self.device} on {self.hostname or self.host} (pid {self.pid})"

    def short(self, rank: int | None = None) -> str:
        """For one-line messages: "worker 1 (Apple M2 on 10.0.0.3)", numbered by `rank` (the current one
        after renumbering) or else by the rank it had when it reported."""
        return f"worker {self.rank if rank is None else rank} ({self.device_name} on {self.host})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class BuildReport:
    """What a worker built, for the preflight to compare across workers. `problem` is set (and the device
    fields are empty) when the worker could not build, so every worker's problem shows in one table."""

    rank: int
    host: str
    requested: str
    versions: dict[str, str]
    problem: str | None = None
    device: DeviceInfo | None = None
    precision: str = ""
    signature: str | None = None
    tensors: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    """(name, shape, dtype) of every parameter and buffer: a model that differs is named down to the tensor."""
    num_params: int = 0
    trainable_bytes: int = 0
    nccl: bool = False
    max_grad_norm: float | None = None
    """The task clips the gradient norm (not every strategy can)."""
    hf_model: HFModelSpec | None = None
    """The model is a transformers.PreTrainedModel: its class and config (the final weights get a save_pretrained
    folder too)."""
    frozen: FrozenBase | None = None
    """The model's frozen parameters (a LoRA base), when it has some: checkpoints leave them out (frozen_base).
    Rank 0's report only (the reference)."""
    shape: ModelShape | None = None
    """The training state's figures (weights, blocks, the optimizer's expected state): ScalingConfig(shard="auto")
    weighs them against each worker's memory. Rank 0's report only (the reference)."""


@dataclass(frozen=True, kw_only=True)
class DataReport:
    """What a worker opened: sample counts, and fingerprints of a few samples when it built the data itself."""

    rank: int
    num_train: int
    num_eval: int
    train_fingerprint: str = ""
    eval_fingerprint: str = ""
    problem: str = ""
    """Why the task cannot train on these samples (Task.batch_problem), or ""."""


@dataclass(frozen=True, kw_only=True)
class NumericsResult:
    """A device's gradient against the CPU's in fp32: relative L2 error and the tolerance it is held to."""

    rank: int
    error: float
    tolerance: float


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One device measured before training."""

    rank: int
    samples_per_s: float
    """Forward+backward samples per second (emulated slowdown included)."""
    batch: int
    """The micro-batch it was timed at."""
    memory_cap: int | None
    """The largest micro-batch to run (None: no limit found up to the global batch)."""
    peak_bytes: int | None = None
    """Device memory at its peak while timing `batch` (CUDA), or the process's peak resident set (CPU)."""
    load_s_per_sample: float = 0.0
    """Seconds reading and collating one training sample took (measured once, on the samples the probe read):
    part of `samples_per_s`, which counts a step as loading its samples, then computing."""


@dataclass(frozen=True)
class LeftOut:
    """A worker left out before or during training, and why."""

    worker: WorkerInfo
    reason: str


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """One driver call: `num_steps` global steps of `epoch` starting at `first_step`."""

    epoch: int
    first_step: int
    num_steps: int
    shares: tuple[int, ...]
    global_batch: int
    drift_tolerance: float
    micro_batches: tuple[int, ...] = ()
    """Per worker, the largest micro-batch (empty: the whole share at once)."""
    round_index: int = 0
    """How many rounds the driver ran before this one."""


@dataclass
class WorkerReport:
    """One worker's account of a round."""

    rank: int
    samples: int = 0
    compute_s: list[float] = field(default_factory=list)
    """Per step: forward, backward and the optimizer step."""
    comm_s: list[float] = field(default_factory=list)
    """Per step: time inside collectives, waiting for slower peers included."""
    losses: list[float] = field(default_factory=list)
    """Per step: the global mean loss (the same on every rank)."""
    skipped_steps: list[int] = field(default_factory=list)
    nonfinite_steps: list[int] = field(default_factory=list)
    """Steps whose loss on THIS worker was NaN or Inf (names the worker behind a skipped step)."""
    drift: float = 0.0
    rebroadcast: bool = False
    round_comm_s: float = 0.0
    wall_s: float = 0.0
    staleness: list[int] = field(default_factory=list)
    """Per step: how many updates old the weights its gradient was computed on were (ps-async)."""
    grad_norms: list[float] = field(default_factory=list)
    """Per applied step, when the task clips: the gradient's norm before clipping."""
    sent_bytes: int = 0
    """Gradient or delta bytes this worker sent (wire size; buffers and drift checks not counted)."""
    cpu_share: float | None = None
    """CPU workers: the share of a core the forward and backward passes got while they could run (1.0: a core
    whenever they could run; 0.5: a busy machine gave them half; devices.cpu.CpuShare). None on accelerators
    and where the OS does not tell (Linux only)."""
    cpu_wait_s: float = 0.0
    """With cpu_share: the seconds of the round's forward and backward passes spent runnable but waiting for a
    core, which a core of their own would have saved."""
    memory_bytes: int | None = None
    """Memory this worker held on its device (CUDA: the round's peak; CPU: the process's peak resident set)."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """What the replica holds, by part: weights, grads, optimizer (this rank's slice when sharded), strategy."""
    peer_lost: str = ""
    """Set when a collective failed because a peer died or stopped answering; the round did not finish."""
    peer_silent: bool = False
    """With peer_lost: the collective timed out, so a peer has been silent for the whole collective timeout
    already (a closed connection is not this: the peer died, or left on purpose, as after out of memory)."""
    out_of_memory: bool = False
    """With peer_lost: this worker ran out of device memory (its message says so); the others lost it as a peer."""
    lr: list[float] = field(default_factory=list)
    """Per optimizer param group, the learning rate after the round's last step (and scheduler step): what the
    next round starts with. Empty when the round did not finish."""
    committed_steps: int = 0
    """How many of the round's steps stand should the round turn out failed (a peer lost): this replica's
    committed steps; all of them after a round it finished; 0 under parameter servers (rounds are redone whole)."""


@dataclass(frozen=True, kw_only=True)
class LoopRequest:
    """A user's training loop to run on every worker (mixtrain.train): the function, its config, and what the
    loop's session needs."""

    fn: Any
    """train_loop_per_worker: called as fn(config) when it takes a parameter, else fn()."""
    config: dict[str, Any] | None
    seed: int
    shares: Any
    """ScalingConfig.shares."""
    bucket_bytes: int
    sink: Any
    """The driver's report sink (a Ray actor)."""
    checkpoint: Any = None
    """The files of the checkpoint get_checkpoint() returns (an object ref to {relative path: bytes}), or None."""
    experiment_name: str = ""
    attempt: int = 0
    """How many times the loop was started before (restarts after lost workers)."""
    places: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """rank -> (local rank, workers on its node, node rank)."""
    batch_workers: int = 0
    """The workers the run asked for: a prepared loader's global batch is its batch_size times this, also after a
    worker is lost (0: the workers there are)."""
    leave_out_gain: float | None = None
    """See LoopSession.leave_out_gain."""
    rebalance_threshold: float = 0.1
    """See LoopSession.rebalance_threshold."""
    global_batches: list[int] = field(default_factory=list)
    """The run's global batch of each prepared loader, fixed by the first attempt that prepared it (see
    LoopSession.global_batches)."""


@dataclass(frozen=True, kw_only=True)
class LoopDevice:
    """A loop worker's device once resolved: who the worker is, and what the group's backend is chosen from (as a
    Task's BuildReport tells it)."""

    info: WorkerInfo
    uuid: str
    """The physical device's identity (DeviceInfo.uuid; empty for CPUs): two workers with one share a GPU."""
    nccl: bool
    """This torch has NCCL."""


@dataclass(frozen=True, kw_only=True)
class LoopOutcome:
    """How a worker's loop ended: "finished", "stopped" (Ctrl-C, at a report), "peer_lost" (a collective failed:
    another worker was lost) or "error" (the loop raised; `error` is its traceback)."""

    rank: int
    status: str
    error: str = ""
    error_type: str = ""
