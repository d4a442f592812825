"""Waiting on calls to the workers, with one rule for deadlines and errors: results in rank order, the first
failure raised at once (WorkerError, WorkerTimeout), or, where a lost worker is to be survived, the lost ones
reported with what happened. The calls themselves are typed (group/worker_calls.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import ray

from mixtrain.comm import state_transfer
from mixtrain.group.membership import Membership
from mixtrain.group.worker_calls import Pending, WorkerCalls

T = TypeVar("T")


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank and node and carries its traceback."""


class WorkerTimeout(WorkerError):
    """Workers did not answer in time (stopped, asleep, hung, or on a link slower than the deadline allows)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
STREAM_AHEAD = 128
"""A streamed state's pieces a worker sends ahead of what the driver has read (128 x 64 KB: 8 MB). Unbounded, a
worker runs through the whole state at once and the pieces the driver has not read yet pile up in both processes:
rank 0's peak was 20-100 MB higher and the driver's 60-200 MB on a 12.6M-parameter AdamW state. It costs little:
150 MB took 0.6-0.7 s instead of 0.3-0.6 s on one machine."""


Streamed = Callable[[WorkerCalls, int], Iterator[Any]]
"""One of WorkerCalls' streamed copies (WorkerCalls.stream_training_state, ...): what GroupCalls.receive reads."""


def error_text(exc: BaseException) -> str:
    """What a Ray error says, without the terminal colours Ray puts in."""
    return _ANSI.sub("", str(exc))


def _describe(rank: int, method: str, exc: Exception) -> str:
    text = error_text(exc)
    message = f"worker {rank} failed in {method}():\n{text}"
    if "ModuleNotFoundError" in text or "No module named" in text:
        message += (
            "\nFix: the task factory (and what it imports) must be importable on every worker: define it in an "
            "installed package, or in a module under the folder you start from (local workers share your working "
            "directory), or set PYTHONPATH for the Ray nodes."
        )
    return message


def lost_reason(exc: Exception) -> str:
    return f"its process died or its node left ({error_text(exc).splitlines()[0][:160]})"


class GroupCalls:
    """Calls to the active members of `members`, in rank order."""

    members: Membership

    def each(
        self, call: Callable[[WorkerCalls], Pending[T]], *, timeout_s: float, ranks: Iterable[int] | None = None
    ) -> list[T]:
        """`call(worker)` on the given ranks (all by default); the results in rank order."""
        active = self.members.active
        ranks = range(len(active)) if ranks is None else ranks
        return self.gather({r: call(active[r].worker) for r in ranks}, timeout_s)

    def gather(self, pending: dict[int, Pending[T]], timeout_s: float) -> list[T]:
        """Wait for every call (by rank) within `timeout_s`, but raise at the FIRST failure rather than after the
        slowest rank: WorkerTimeout names who did not answer, WorkerError who failed and how."""
        rank_of = {p.ref: r for r, p in pending.items()}
        method = next(iter(pending.values())).method if pending else ""
        results: dict[int, T] = {}
        waiting = list(rank_of)
        deadline = time.monotonic() + timeout_s
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(rank_of[p] for p in waiting)
                raise WorkerTimeout(
                    f"worker(s) {missing} did not finish {method}() within {timeout_s:g} s; see the timeouts "
                    "MIXTRAIN_*_TIMEOUT_S in docs/config.md",
                    missing,
                )
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                raise WorkerError(_describe(rank_of[ready[0]], method, exc)) from exc
        return [results[r] for r in sorted(results)]

    def tolerant(
        self, call: Callable[[WorkerCalls], Pending[T]], *, timeout_s: float, grace_s: float, peer_grace_s: float
    ) -> tuple[dict[int, T], dict[int, str]]:
        """`call(worker)` on every rank, surviving lost workers: returns (results by rank, the lost ranks with what
        happened). A worker is lost when its process died or, once another worker has died, it has not answered
        within `grace_s` (stopped, asleep or hung); once another worker reported a silent peer (its collective timed
        out: the silent one had that long already), within `peer_grace_s`. Any other error in a worker is raised as
        WorkerError: that is a bug or a device error, not a loss."""
        pending = {r: call(m.worker) for r, m in enumerate(self.members)}
        rank_of = {p.ref: r for r, p in pending.items()}
        results: dict[int, T] = {}
        lost: dict[int, str] = {}
        waiting = list(rank_of)
        deadline = time.monotonic() + timeout_s
        waited = timeout_s
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:  # the process died or its node is gone
                lost[rank] = lost_reason(exc)
            except ray.exceptions.RayError as exc:
                raise WorkerError(_describe(rank, pending[rank].method, exc)) from exc
            wait = self._grace(results.get(rank), bool(lost), grace_s, peer_grace_s)
            if wait is not None:
                deadline, waited = min(deadline, time.monotonic() + wait), min(waited, wait)
        for ref in waiting:
            lost[rank_of[ref]] = (
                f"did not answer within {waited:g} s after a peer failed (stopped, asleep or hung; "
                "MIXTRAIN_COLLECTIVE_TIMEOUT_S, MIXTRAIN_LOST_GRACE_S)"
            )
        return results, lost

    @staticmethod
    def _grace(result: Any, any_lost: bool, grace_s: float, peer_grace_s: float) -> float | None:
        """How long the rest get after this answer: `grace_s` once a worker died; after a report of a failed
        collective, `peer_grace_s` when it timed out (a silent peer had the whole timeout already), else `grace_s`
        (a peer that died or left on purpose says nothing of the rest, which may still compute on a loaded
        machine). None: no change."""
        if any_lost:
            return grace_s
        if result is not None and bool(getattr(result, "peer_lost", "")):
            return peer_grace_s if getattr(result, "peer_silent", False) else grace_s
        return None

    def nearest(self) -> int:
        """The rank to read an equal replica's state from: the first on the driver's own node (Membership.nearest)."""
        return self.members.nearest(ray.get_runtime_context().get_node_id())

    def receive(self, rank: int, streamed: Streamed, *, stall_s: float) -> Any:
        """A streamed copy (e.g. WorkerCalls.stream_training_state) from worker `rank`, in small pieces: no deadline
        for the whole (a large model on a slow link takes as long as it takes), but a peer silent for `stall_s`
        between two pieces is WorkerTimeout, and a dead one WorkerError."""
        gen = streamed(self.members[rank].worker, STREAM_AHEAD)
        what = streamed.__name__.removeprefix("stream_")

        def pieces() -> Iterator[Any]:
            while True:
                ready, _ = ray.wait([gen], timeout=stall_s)
                if not ready:
                    raise WorkerTimeout(f"worker {rank} sent nothing of {what} for {stall_s:g} s", [rank])
                try:
                    yield ray.get(next(gen))
                except StopIteration:
                    return
                except ray.exceptions.RayError as exc:
                    raise WorkerError(_describe(rank, streamed.__name__, exc)) from exc

        return state_transfer.receive(pieces())
