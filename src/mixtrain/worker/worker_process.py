"""A worker process: what every worker of a run is, whichever door it serves. It logs into the run folder, holds
its rank, opens and joins the collective group's rendezvous, and can be kept for the next fit (warm_workers). The
`Task` replica (worker/replica.py TrainWorker) and the loop runner (train/_loop_worker.py LoopWorker) build on it."""

from __future__ import annotations

import gc
import os
import socket
import sys
from pathlib import Path

import torch

from mixtrain import devices
from mixtrain.comm import netif, process_group
from mixtrain.devices import host_allocator
from mixtrain.observe import worker_log
from mixtrain.records.messages import JoinRequest, WorkerInfo, WorkerSetup
from mixtrain.worker import warm_workers


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class WorkerProcess:
    """One worker process on one device. Every method is called by the driver for all ranks at once (SPMD)."""

    def __init__(self, setup: WorkerSetup) -> None:
        host_allocator.release_large_blocks()
        self._modules_at_start = set(sys.modules)  # what a kept worker keeps loaded (warm_workers)
        self._torch_settings = warm_workers.torch_settings()  # and the process-wide torch settings it goes back to
        self._module_stats: dict[str, tuple[int, int] | None] = {}  # the user's modules as the last task was built
        self._setup(setup)
        # What the imports made (torch, Ray: about 200,000 objects) lives as long as the process: out of the
        # collector's sight, a full collection (shutdown's, or Python's own now and then mid-round) walks only
        # what the runs made. It took 0.15-0.27 s per shutdown, and 4.6 s on a loaded machine, past the wait a
        # kept worker is given to answer.
        gc.freeze()

    def _setup(self, setup: WorkerSetup) -> None:
        self.log_file: Path | None = None
        self._log_elsewhere = False  # written outside the run folder (another node): the driver copies it back
        rank, log_to = setup.rank, setup.log_to
        if log_to is not None:
            name = f"worker-{rank}-{setup.device_request.replace(':', '')}-pid{os.getpid()}.log"
            self.log_file = worker_log.log_path(log_to[0], log_to[1], _node_id(), name)
            self._log_elsewhere = self.log_file.parent != Path(log_to[0])
            worker_log.redirect_output(self.log_file)
            worker_log.log.info(
                "worker %d of %d on %s, asking for %s",
                rank,
                setup.world_size,
                socket.gethostname(),
                setup.device_request,
            )
        else:
            worker_log.restore_output()
        torch.set_num_threads(setup.num_threads)
        self.rank = rank
        self.world_size = setup.world_size
        self.seed = setup.seed
        self.host = _node_ip()
        self.device_request = setup.device_request
        self.kind: devices.DeviceKind = devices.get("cpu")
        self.device = torch.device("cpu")
        self.precision = "fp32"
        self._rendezvous: process_group.Rendezvous | None = None

    def reuse(self, setup: WorkerSetup) -> None:
        """A kept worker (warm_workers) starts over for the next fit, as a new actor with `setup` would: nothing
        of the last fit's task, data, group, user modules or torch defaults stays."""
        self.shutdown()
        warm_workers.forget_edited_modules(self._modules_at_start, self._module_stats)
        warm_workers.restore_torch_settings(self._torch_settings)
        warm_workers.reset_peak_rss()
        self._setup(setup)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            rank=self.rank,
            host=self.host,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            node_id=_node_id(),
            device=str(self.device),
            device_name=self.kind.name(),
            precision=self.precision,
            threads=torch.get_num_threads(),
        )

    def set_rank(self, rank: int, world_size: int) -> None:
        """New numbering after the driver left some workers out (before the group forms)."""
        self.rank, self.world_size = rank, world_size

    def open_rendezvous(self, timeout_s: float, local: bool) -> tuple[str, int, str]:
        """Rank 0: the store of a new formation, on loopback when every worker is on this node (`local`), else on
        this node's address; (host, port, key prefix) for every rank's JoinRequest."""
        self._close_rendezvous()
        host = netif.LOOPBACK if local else self.host
        self._rendezvous = process_group.Rendezvous(host, timeout_s)
        return host, self._rendezvous.port, self._rendezvous.prefix

    def _close_rendezvous(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def _join_group(self, request: JoinRequest) -> None:
        """Join the collective group at rank 0's rendezvous (the store rank 0 opened, under the request's prefix)."""
        rendezvous = self._rendezvous if self.rank == 0 else None
        # a store on loopback: every worker is on this node, and the collectives stay on loopback too
        netif.pin_interface(request.host if netif.is_loopback(request.host) else self.host, request.backend)
        if request.backend == "nccl":
            self.kind.make_current(self.device.index or 0)
        process_group.join_group(
            backend=request.backend,
            rank=self.rank,
            world_size=self.world_size,
            host=request.host,
            port=request.port,
            prefix=request.prefix,
            rendezvous_timeout_s=request.rendezvous_timeout_s,
            collective_timeout_s=request.collective_timeout_s,
            rendezvous=rendezvous,
        )

    def rng_state(self) -> dict:
        """This worker's random streams (dropout and the like), on the CPU."""
        out = {"cpu": torch.get_rng_state()}
        device = self.kind.rng_state()
        if device is not None:
            out[self.kind.kind] = device
        return out

    def log_text(self) -> tuple[str, str] | None:
        """(file name, the end of this worker's log) when it was written on another node than the driver's,
        for the driver to copy into the run folder; None when it is there already."""
        if self.log_file is None or not self._log_elsewhere or not self.log_file.is_file():
            return None
        return self.log_file.name, worker_log.read_tail(self.log_file)

    def leave(self) -> None:
        """Leave the process group (before the driver re-forms it without some workers)."""
        process_group.leave_group()
        self._close_rendezvous()

    def shutdown(self) -> None:
        """Leave the group and let go of what the run built here and the device memory it held: a worker left out,
        or kept idle for the next fit (warm_workers), holds nothing the others or the user could use."""
        process_group.leave_group()
        self._release()
        self._rendezvous = None
        gc.collect()
        self.kind.empty_cache()

    def _release(self) -> None:
        """What a subclass built for the run (a task, its data): let go at shutdown."""
