"""The worker that runs a user's own training loop (mixtrain.train): a WorkerProcess as the `Task` path's
TrainWorker is (device, logs, rendezvous), with the loop in place of mixtrain's replica and step loop. The loop's
calls to mixtrain.train (prepare_model, prepare_data_loader, report, get_context, get_checkpoint) find this worker
through the session."""

from __future__ import annotations

import inspect
import shutil
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
import torch.distributed

from mixtrain import _constants, devices
from mixtrain.comm import process_group
from mixtrain.observe import worker_log
from mixtrain.records.messages import JoinRequest, LoopDevice, LoopOutcome, LoopRequest
from mixtrain.train import _session
from mixtrain.train.checkpoint import Checkpoint, write_files
from mixtrain.worker.worker_process import WorkerProcess


class LoopWorker(WorkerProcess):
    """The user's loop on one device: none of the `Task` replica's methods, only what a loop run calls."""

    def prepare_device(self) -> LoopDevice:
        """Resolve the device where this actor landed (CUDA, else MPS, else CPU, as asked)."""
        self.kind = devices.resolve(self.device_request)
        self.device = self.kind.torch_device(0)
        if self.kind.kind == "cuda":
            self.kind.make_current(0)
        return LoopDevice(info=self.info(), uuid=self.kind.uuid(0), nccl=torch.distributed.is_nccl_available())

    def join_loop(self, request: JoinRequest) -> None:
        """Join the collective group the loop's prepared models exchange their gradients over."""
        self._join_group(request)

    def run_loop(self, request: LoopRequest) -> LoopOutcome:
        """Run the user's loop with this worker's session; how it ended, never an exception for a loop that
        raised (the driver names the worker and stops the others at once)."""
        folder = None
        checkpoint = None
        if request.checkpoint is not None:
            folder = Path(tempfile.mkdtemp(prefix="mixtrain-checkpoint-"))
            files = ray.get(request.checkpoint)
            write_files(files, folder)
            checkpoint = Checkpoint(folder)
        _session.start(self._new_session(request, checkpoint))
        try:
            with self._output_shown(request.sink):
                _call(request.fn, request.config)
        except _session.LoopStopped:
            return LoopOutcome(rank=self.rank, status="stopped")
        except SystemExit as exc:  # a script's sys.exit() (argparse's too): its status is the outcome
            if exc.code in (None, 0):
                return LoopOutcome(rank=self.rank, status="finished")
            return LoopOutcome(
                rank=self.rank, status="error", error=f"the loop exited with status {exc.code}", error_type="SystemExit"
            )
        except Exception as exc:
            if process_group.is_peer_failure(exc):
                return LoopOutcome(rank=self.rank, status="peer_lost", error=str(exc).splitlines()[0][:300])
            return LoopOutcome(
                rank=self.rank, status="error", error=traceback.format_exc(), error_type=type(exc).__name__
            )
        finally:
            _session.end()
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        return LoopOutcome(rank=self.rank, status="finished")

    @contextmanager
    def _output_shown(self, sink: Any) -> Iterator[None]:
        """Rank 0's output while the loop runs goes to the driver's terminal too (line by line, as it is
        written to this worker's log), as torchrun shows a rank's prints; the other ranks' stays in the logs."""
        if self.rank != 0 or self.log_file is None:
            yield
            return

        def send(lines: list[str], wait: bool) -> None:
            sent = sink.output_lines.remote(lines)
            if wait:  # the last lines are at the driver before the loop's end is
                ray.get(sent)

        follower = worker_log.LogFollower(self.log_file, send, _constants.env_float(_constants.OUTPUT_POLL_S))
        try:
            yield
        finally:
            try:
                follower.stop()
            except Exception as exc:  # the driver's sink gone (the run ends): the log file has every line
                worker_log.log.warning("the loop's last output lines were not shown on the driver: %s", exc)

    def _new_session(self, request: LoopRequest, checkpoint: Checkpoint | None) -> _session.LoopSession:
        local_rank, local_world_size, node_rank = request.places.get(self.rank, (0, 1, 0))
        context = _session.TrainContext(
            world_rank=self.rank,
            world_size=self.world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            device=self.device,
            experiment_name=request.experiment_name,
        )
        sink = request.sink
        session = _session.LoopSession(
            context=context,
            seed=request.seed,
            shares=request.shares,
            bucket_bytes=request.bucket_bytes,
            report_to=lambda rank, index, metrics, files: ray.get(
                sink.report.remote(rank, (request.attempt, index), metrics, files)
            ),
            plan_to=lambda record: sink.event.remote("plan", record),
            event_to=lambda kind, record: ray.get(sink.event.remote(kind, record)),
            checkpoint=checkpoint,
            batch_workers=request.batch_workers or self.world_size,
            leave_out_gain=request.leave_out_gain,
            rebalance_threshold=request.rebalance_threshold,
            global_batches=list(request.global_batches),
        )
        context = _session.TrainContext(**{**context.__dict__, "_session": session})
        session.context = context
        return session


def _call(fn: Any, config: dict[str, Any] | None) -> Any:
    """fn(config) when it takes a parameter (Ray Train's train_loop_per_worker(config)), else fn()."""
    try:
        takes = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        takes = config is not None
    return fn(config if config is not None else {}) if takes else fn()
