"""Typed calls to a LoopWorker: WorkerCalls and the three methods a loop run adds (train/_loop_worker.py)."""

from __future__ import annotations

from mixtrain.group.worker_calls import Pending, WorkerCalls
from mixtrain.records.messages import JoinRequest, LoopDevice, LoopOutcome, LoopRequest


class LoopCalls(WorkerCalls):
    def prepare_device(self) -> Pending[LoopDevice]:
        return Pending(self.actor.prepare_device.remote(), "prepare_device")

    def join_loop(self, request: JoinRequest) -> Pending[None]:
        return Pending(self.actor.join_loop.remote(request), "join_loop")

    def run_loop(self, request: LoopRequest) -> Pending[LoopOutcome]:
        return Pending(self.actor.run_loop.remote(request), "run_loop")
