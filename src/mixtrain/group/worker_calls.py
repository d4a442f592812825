"""Typed calls to one worker process: each method of `WorkerCalls` is the `TrainWorker` method of the same name and
signature, started on the worker's Ray actor, and returns a `Pending` of what that method returns. A reader (and
mypy, and an IDE) follows a call from the controller to here and on to TrainWorker; the worker group waits for
results with one deadline and one error rule (group/worker_group.py). tests/unit/test_worker_calls.py checks that
every method here matches TrainWorker's signature."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from mixtrain.cluster import ray_shim
from mixtrain.records.messages import (
    BuildReport,
    DataReport,
    JoinRequest,
    NumericsResult,
    ProbeResult,
    RoundPlan,
    WorkerInfo,
    WorkerReport,
    WorkerSetup,
)

T = TypeVar("T")


class Pending(Generic[T]):
    """One call in flight to one worker: its result will be a T. `ref` is Ray's object ref (it can be handed to
    another worker's call, which then reads the result straight from the object store)."""

    def __init__(self, ref: Any, method: str) -> None:
        self.ref = ref
        self.method = method


class WorkerCalls:
    """The proxy to one TrainWorker actor (`actor`: its Ray handle)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def reuse(self, setup: WorkerSetup) -> Pending[None]:
        return Pending(self.actor.reuse.remote(setup), "reuse")

    def info(self) -> Pending[WorkerInfo]:
        return Pending(self.actor.info.remote(), "info")

    def set_rank(self, rank: int, world_size: int) -> Pending[None]:
        return Pending(self.actor.set_rank.remote(rank, world_size), "set_rank")

    def build(self, factory: Callable[[], Any]) -> Pending[BuildReport]:
        return Pending(self.actor.build.remote(factory), "build")

    def check_numerics(self, tolerance: float | None = None, count: int = 8) -> Pending[NumericsResult]:
        return Pending(self.actor.check_numerics.remote(tolerance, count), "check_numerics")

    def probe(
        self, guess: int, limit: int, memory_cap: int | None = None, forward_only: bool = False
    ) -> Pending[ProbeResult]:
        return Pending(self.actor.probe.remote(guess, limit, memory_cap, forward_only), "probe")

    def measure_comm(self, repeats: int = 5) -> Pending[tuple[float, int]]:
        return Pending(self.actor.measure_comm.remote(repeats), "measure_comm")

    def leave(self) -> Pending[None]:
        return Pending(self.actor.leave.remote(), "leave")

    def open_rendezvous(self, timeout_s: float, local: bool) -> Pending[tuple[str, int, str]]:
        return Pending(self.actor.open_rendezvous.remote(timeout_s, local), "open_rendezvous")

    def join(self, request: JoinRequest) -> Pending[None]:
        return Pending(self.actor.join.remote(request), "join")

    def load_data(self, train: Any, evaluation: Any) -> Pending[DataReport]:
        return Pending(self.actor.load_data.remote(train, evaluation), "load_data")

    def run_round(self, plan: RoundPlan) -> Pending[WorkerReport]:
        return Pending(self.actor.run_round.remote(plan), "run_round")

    def evaluate(self, start: int, stop: int, batch: int) -> Pending[dict[str, float]]:
        return Pending(self.actor.evaluate.remote(start, stop, batch), "evaluate")

    def training_state(self) -> Pending[dict[str, Any]]:
        return Pending(self.actor.training_state.remote(), "training_state")

    def optimizer_part(self) -> Pending[dict[str, Any]]:
        return Pending(self.actor.optimizer_part.remote(), "optimizer_part")

    def rng_state(self) -> Pending[dict[str, Any]]:
        return Pending(self.actor.rng_state.remote(), "rng_state")

    def load_training_state(
        self, state: Any, rng: dict[str, Any] | None = None, rank_state: dict[str, Any] | None = None
    ) -> Pending[None]:
        """`state`: a packed state, or the ref of another worker's training_state() (read from the store)."""
        return Pending(self.actor.load_training_state.remote(state, rng, rank_state), "load_training_state")

    def recover(self) -> Pending[None]:
        return Pending(self.actor.recover.remote(), "recover")

    def state_dict(self) -> Pending[dict[str, Any]]:
        return Pending(self.actor.state_dict.remote(), "state_dict")

    def log_text(self) -> Pending[tuple[str, str] | None]:
        return Pending(self.actor.log_text.remote(), "log_text")

    def shutdown(self) -> Pending[None]:
        return Pending(self.actor.shutdown.remote(), "shutdown")

    # The streamed copies, each as Ray's streaming generator at most `ahead` pieces ahead of the reader.
    def stream_training_state(self, ahead: int) -> Iterator[Any]:
        return ray_shim.streaming(self.actor.stream_training_state, ahead).remote()

    def stream_optimizer_part(self, ahead: int) -> Iterator[Any]:
        return ray_shim.streaming(self.actor.stream_optimizer_part, ahead).remote()

    def stream_state_dict(self, ahead: int) -> Iterator[Any]:
        return ray_shim.streaming(self.actor.stream_state_dict, ahead).remote()

    def stream_rank_state(self, ahead: int) -> Iterator[Any]:
        return ray_shim.streaming(self.actor.stream_rank_state, ahead).remote()
