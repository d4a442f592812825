"""TorchTrainer: the user's training loop on every worker, on mixtrain's devices, shares and recovery.

One attempt: start (or restart) a process in every bundle, resolve each one's device, form the collective group,
run the loop on all of them, and read their reports while they run. A worker lost (its process died, its node left)
ends the attempt: the others, stuck in a collective with it, are stopped at once, and the loop starts again on every
bundle that can hold a worker, from the last checkpoint the run reported (get_checkpoint()), up to
FailureConfig.max_failures within an hour. A loop that raises ends the run with the worker's traceback; Ctrl-C
stops every worker at its next report. What follows each attempt is decided in _driver.py (a state machine, unit-tested
without Ray); this module carries it out on Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mixtrain.cluster import connect, ray_shim
from mixtrain.comm.process_group import group_backend
from mixtrain.config import ScalingConfig
from mixtrain.driver.interrupt import GracefulStop
from mixtrain.errors import InputTypeError
from mixtrain.group.group_ops import form_group
from mixtrain.group.membership import Member, Membership
from mixtrain.group.worker_group import WorkerGroup, lost_reason
from mixtrain.observe.progress import ProgressView
from mixtrain.observe.runlog import RunLog, check_new_run_dir, make_folder, new_run_name
from mixtrain.policies.decisions import FailureBudget
from mixtrain.records.messages import LoopDevice, LoopOutcome, LoopRequest
from mixtrain.records.tunables import Tunables
from mixtrain.train._driver import AttemptOutcome, LoopDriver
from mixtrain.train._driver import restart_from as restart_from
from mixtrain.train._loop_calls import LoopCalls
from mixtrain.train._loop_worker import LoopWorker
from mixtrain.train._result import Result
from mixtrain.train._settings import check_loop_scaling, check_ray_options
from mixtrain.train._sink import ReportSink
from mixtrain.train._store import LoopCheckpoints
from mixtrain.train.checkpoint import Checkpoint
from mixtrain.train.config import RunConfig


class LoopGroup(WorkerGroup):
    """The worker group of a loop run: LoopWorker processes, restarted whole between attempts."""

    worker_cls = LoopWorker
    calls_cls = LoopCalls
    left_out: list[int]
    """Bundles left out for being slow: they get no worker again in this run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.left_out = []

    def restart(self, wait_s: float, excluded: Sequence[int] = ()) -> list[int]:
        """Stop every worker and start a new one in each bundle of the run but the `excluded` ones (left out for
        being slow); a bundle whose worker does not answer within `wait_s` (its node is gone) stays empty for this
        attempt. Returns the bundles left empty."""
        for member in self.members.alive:
            ray.kill(member.worker.actor)
        self.left_out += list(excluded)
        specs = sorted([*(m.spec for m in self.members.active), *self.members.vacant], key=lambda s: s.rank)
        specs = [s for s in specs if s.rank not in self.left_out]
        started = [self._start_actor(spec, i, len(specs)) for i, spec in enumerate(specs)]
        probes = [ray_shim.ready(w.actor, w.actor.info.remote) for w in started]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=wait_s)
        members, empty = [], []
        for spec, worker, probe in zip(specs, started, probes):
            if probe in ready:
                members.append(Member(worker=worker, spec=spec))
            else:
                ray.kill(worker.actor)
                empty.append(spec.rank)
        self.members = Membership(members)
        self.members.vacant = [s for s in specs if s.rank in empty]
        self.renumber()
        return empty


class TorchTrainer:
    """Ray Train's TorchTrainer on mixtrain: `TorchTrainer(train_loop_per_worker, train_loop_config=None,
    scaling_config=ScalingConfig(...), run_config=RunConfig(...)).fit() -> Result`."""

    worker_group_cls: type[LoopGroup] = LoopGroup

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        **_ray_options: Any,
    ) -> None:
        if not callable(train_loop_per_worker):
            raise InputTypeError("TorchTrainer(train_loop_per_worker=...): give the function every worker runs")
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise InputTypeError(f"TorchTrainer(train_loop_config={train_loop_config!r}): give a dict or None")
        scaling_config = scaling_config or ScalingConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise InputTypeError("TorchTrainer(scaling_config=...): give a mixtrain.train.ScalingConfig")
        check_loop_scaling(scaling_config)
        check_ray_options(_ray_options)
        run_config = run_config or RunConfig()
        if not isinstance(run_config, RunConfig):
            raise InputTypeError("TorchTrainer(run_config=...): give a mixtrain.train.RunConfig")
        self.fn = train_loop_per_worker
        self.config = train_loop_config
        self.scaling = scaling_config
        self.run = run_config
        self.resume_from = resume_from_checkpoint

    def fit(self) -> Result:
        """Run the loop on every worker until it returns on all of them; see the module's docstring."""
        run_dir, resume = self._run_dir()
        tunables = Tunables.from_env()
        connect.ensure_ray(self.scaling.address, _cpus(self.scaling))
        group = self.worker_group_cls(self.scaling, self.run.seed, tunables)
        group.log_dir = run_dir / "logs"
        log = RunLog(run_dir, {"scaling": self.scaling, "run": self.run, "loop": getattr(self.fn, "__name__", "")})
        view = ProgressView(self.run.progress, 0)
        sink = _start_sink(run_dir, self.run.keep_checkpoints, resume._global_batches if resume is not None else [])
        run = _Run(self, group, sink, log, view, tunables, resume)
        budget = FailureBudget(self.run.failure_config.max_failures, tunables.failure_window_s)
        driver = LoopDriver(run, budget, log=log, view=view)
        finished = False
        try:
            with GracefulStop() as stop:
                run.stop = stop
                group.start()
                stop.arm()
                driver.run()
                result = run.result(run_dir)
                finished = True
        finally:
            view.close()
            group.shutdown(quick=driver.interrupted, finished=finished)  # kept for the next fit where asked
            ray.kill(sink)
            log.close()
        return result

    def _run_dir(self) -> tuple[Path, Checkpoint | None]:
        """The run's folder, made; a named run whose folder holds checkpoints continues from the newest."""
        root = Path(self.run.storage_path)
        make_folder(root, "RunConfig.storage_path")
        if self.run.name is not None:
            path = root / self.run.name
            found = LoopCheckpoints(path, self.run.keep_checkpoints).latest()
            if found is not None:
                return path, Checkpoint._verified(*found)
            check_new_run_dir(path)
            make_folder(path, "RunConfig.name")
            return path, self.resume_from
        path = root / new_run_name().replace("run-", "loop-", 1)
        make_folder(path, "RunConfig.storage_path")
        return path, self.resume_from


class _Run:
    """One fit's loop on Ray, as the driver's LoopPort (_driver.py): the LoopGroup's workers, the report sink and
    what they reported. The driver decides what follows each attempt; this carries it out."""

    def __init__(
        self,
        trainer: TorchTrainer,
        group: LoopGroup,
        sink: Any,
        log: RunLog,
        view: ProgressView,
        tunables: Tunables,
        resume: Checkpoint | None,
    ) -> None:
        self.trainer, self.group, self.sink, self.log, self.view, self.tunables = (
            trainer,
            group,
            sink,
            log,
            view,
            tunables,
        )
        self.checkpoint_files: Any = ray.put(resume.files()) if resume is not None else None
        if resume is not None:
            view.log(f"resuming from {resume.path}")
        self.stop: GracefulStop | None = None
        self.history: list[dict[str, Any]] = []
        self.workers: list[dict[str, Any]] = []
        self.attempt = 0
        """The attempt running now (the driver's count): in the workers' request and in metrics.jsonl records."""
        self._planned: dict[int, list[int]] = {}
        self.batch_workers = 0
        self._told: set[str] = set()  # what the terminal was told once per run
        self._output_noted = False
        self.resumes = False
        """The loop called get_checkpoint(): a restart goes on from the last checkpoint, not from the start."""

    @property
    def members(self) -> Membership:
        return self.group.members

    @property
    def loop_name(self) -> str:
        return getattr(self.trainer.fn, "__name__", "the loop")

    @property
    def log_dir(self) -> Path | None:
        return self.group.log_dir

    def take_leaving(self) -> dict[str, Any]:
        leaving: dict[str, Any] = ray.get(self.sink.leaving.remote())
        self.sink.clear_leave_out.remote()
        return leaving

    def restart(self, excluded: Sequence[int]) -> list[int]:
        return self.group.restart(self.tunables.placement_timeout_s, excluded)

    def reload_checkpoint(self) -> str | None:
        latest = ray.get(self.sink.latest.remote())
        if latest is None:
            return None
        self.checkpoint_files = ray.put(latest[1])
        return str(latest[0])

    def last_checkpoint(self) -> str | None:
        last: str | None = ray.get(self.sink.checkpoint_path.remote())
        return last

    def bring_up(self) -> None:
        """Each worker resolves its device; the group forms as a Task's does (group/group_ops.form_group), on the
        backend a Task's would get (NCCL only where every worker is CUDA with a GPU of its own)."""
        t, group = self.tunables, self.group
        self.batch_workers = self.batch_workers or len(group.members)  # as started: the global batch keeps it
        found: list[LoopDevice] = group.each(lambda w: _loop(w).prepare_device(), timeout_s=t.setup_s)
        for member, device in zip(group.members, found):
            member.info = device.info
        backend, note = loop_backend(self.trainer.scaling.backend, found)
        form_group(group, lambda w, request: _loop(w).join_loop(request), strategy=None, backend=backend)
        self.workers = [d.info.as_dict() for d in found]
        where = ", ".join(f"{d.info.device} on {d.info.hostname or d.info.host}" for d in found)
        self.view.log(f"mixtrain: {len(found)} workers ({where}), {backend}; run folder {self.log.run_dir}")
        if note is not None:
            self.view.log(note)

    def run_attempt(self, attempt: int) -> AttemptOutcome:
        """Run the loop on every worker and show what they report while it runs. A worker that died ends the
        attempt at once (the others wait in a collective for it); a failed collective with no worker dead (one
        stopped or asleep) gives the rest MIXTRAIN_LOST_GRACE_S to answer; a loop that raised ends it there."""
        self.attempt = attempt
        request = self._request()
        pending = {_loop(m.worker).run_loop(request).ref: r for r, m in enumerate(self.group.members)}
        lost: dict[int, str] = {}
        stopping, stopped_at_report, deadline = False, False, float("inf")
        while pending and not any(why.startswith("its process") for why in lost.values()):
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.25)
            self._drain()
            if self.stop is not None and self.stop.requested and not stopping:
                self.sink.request_stop.remote()
                stopping = True
            for ref in ready:
                rank = pending.pop(ref)
                outcome = self._outcome(rank, ref, lost)
                if outcome is not None and outcome.status == "error":
                    return AttemptOutcome(raised=(rank, outcome.error))
                if outcome is not None and outcome.status == "peer_lost":
                    deadline = min(deadline, time.monotonic() + self.tunables.lost_grace_s)
                stopped_at_report |= outcome is not None and outcome.status == "stopped"
            if time.monotonic() > deadline:
                for rank in pending.values():
                    lost[rank] = f"did not answer within {self.tunables.lost_grace_s:g} s after a peer failed"
                break
        self._drain()
        return AttemptOutcome(lost=lost, stopped_at_report=stopped_at_report, interrupted=stopping)

    def _outcome(self, rank: int, ref: Any, lost: dict[int, str]) -> LoopOutcome | None:
        """One worker's end; None where it died (then it is in `lost`)."""
        try:
            outcome: LoopOutcome = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            lost[rank] = lost_reason(exc)
            return None
        return outcome

    def _request(self) -> LoopRequest:
        infos = [m.info for m in self.group.members]
        nodes: dict[str, int] = {}
        places = {}
        for rank, info in enumerate(infos):
            node = info.node_id if info is not None else ""
            node_rank = nodes.setdefault(node, len(nodes))
            on_node = [r for r, i in enumerate(infos) if (i.node_id if i is not None else "") == node]
            places[rank] = (on_node.index(rank), len(on_node), node_rank)
        return LoopRequest(
            fn=self.trainer.fn,
            config=self.trainer.config,
            seed=self.trainer.run.seed,
            shares=self.trainer.scaling.shares,
            bucket_bytes=self.tunables.bucket_bytes,
            sink=self.sink,
            checkpoint=self.checkpoint_files,
            experiment_name=self.log.run_dir.name,
            attempt=self.attempt,
            places=places,
            batch_workers=self.batch_workers,
            leave_out_gain=self.tunables.exclude_gain if self.trainer.scaling.leave_out_slow else None,
            rebalance_threshold=self.tunables.rebalance_threshold,
            global_batches=ray.get(self.sink.run_batches.remote()),  # as the first attempt (or the checkpoint) fixed
        )

    def _drain(self) -> None:
        """Show and record what the workers reported since the last look."""
        reports, events, output = ray.get(self.sink.take.remote())
        self._show_output(output)
        for report in reports:
            self.history.append(report)
            self.log.write("report", report)
            shown = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items())
            self.view.log(shown)
        for kind, record in events:
            if kind == "resumes":
                self.resumes = True
                continue
            self.log.write(kind, record)
            if kind == "plan":
                self._plan(record)
            elif kind == "loader":
                self._loader(record)

    def _plan(self, record: dict[str, Any]) -> None:
        """A new split (shown when the shares change, not every epoch), and a leave-out the loop cannot take."""
        if "leave_out_kept" in record:
            self._kept(record["leave_out_kept"])
        if self._planned.get(record["global_batch"]) != record["shares"]:
            self._planned[record["global_batch"]] = record["shares"]
            speeds = ", ".join(f"{s:,.0f}" for s in record["speeds"])
            self.view.log(f"shares of {record['global_batch']}: {record['shares']} (samples/s measured: {speeds})")

    def _kept(self, named: dict[str, Any]) -> None:
        """The job would be faster without a worker, but leaving it out restarts the loop, and this loop never
        asks get_checkpoint(): it would train again from its first epoch. So the worker stays; said once a run."""
        if "kept" in self._told:
            return
        self._told.add("kept")
        member = self.group.members[int(named["rank"])]
        who = member.describe(int(named["rank"]))
        why = f"the loop never calls mixtrain.train.get_checkpoint(), so leaving {who} out would restart it from "
        why += "the start"
        self.log.write(
            "leave_out_kept", {"attempt": self.attempt, "worker": member.info, "reason": named["reason"], "why": why}
        )
        self.view.log(
            f"kept {who}, although {named['reason']}: the loop never calls mixtrain.train.get_checkpoint(), so "
            "leaving it out would restart the loop from the start (a loop that resumes from get_checkpoint() goes on "
            "without it)"
        )

    def _loader(self, record: dict[str, Any]) -> None:
        """A prepared loader's global batch: the first attempt's is kept; a later attempt that asks another is told
        once that it keeps the run's."""
        index, fixed, asked = int(record["index"]), int(record["global_batch"]), int(record["asked"])
        if asked != fixed and f"loader {index}" not in self._told:
            self._told.add(f"loader {index}")
            self.view.log(
                f"prepared loader {index + 1} of the loop asks a global batch of {asked} (batch_size x the "
                f"{self.batch_workers} workers of this attempt) and keeps the run's {fixed}, fixed by its first "
                "attempt (or the checkpoint it resumed from): len(loader) and each epoch's steps stay as they were"
            )

    def _show_output(self, lines: list[str]) -> None:
        """Worker 0's output, as it prints it (shown also where RunConfig.progress is off: the lines are the loop's
        own); where every worker's is, said once."""
        if not lines:
            return
        if not self._output_noted:
            self._output_noted = True
            self.view.output([f"(worker 0's output follows; every worker's is in {self.group.log_dir}/worker-*.log)"])
        self.view.output(lines)

    def result(self, run_dir: Path) -> Result:
        metrics = self.history[-1] if self.history else {}
        last = self.last_checkpoint()
        return Result(
            metrics={k: v for k, v in metrics.items() if k not in ("report", "checkpoint")},
            checkpoint=Checkpoint(last) if last else None,
            path=str(run_dir),
            metrics_history=list(self.history),
            workers=self.workers,
        )


def loop_backend(requested: str, found: Sequence[LoopDevice]) -> tuple[str, str | None]:
    """The loop's collective backend, chosen as a Task's is (comm/process_group.group_backend), and the note
    where NCCL was passed over."""
    return group_backend(requested, [(d.info.host, d.info.device.split(":")[0], d.uuid, d.nccl) for d in found])


def _loop(worker: Any) -> LoopCalls:
    """A member's proxy, as the LoopCalls a LoopGroup makes."""
    assert isinstance(worker, LoopCalls)
    return worker


def _start_sink(run_dir: Path, keep: int, global_batches: list[int]) -> Any:
    """The report sink, on this (the driver's) node: it writes the checkpoints into the run folder."""
    here = ray.get_runtime_context().get_node_id()
    remote: Any = ray.remote(ReportSink)
    return remote.options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)
    ).remote(
        str(run_dir.absolute()), keep, global_batches
    )  # absolute: an actor works in its Ray node's folder, not the driver's


def _cpus(scaling: ScalingConfig) -> float:
    if scaling.is_auto:
        return 0.0
    return sum(g.resources()["CPU"] * g.num_workers for g in scaling.device_groups())
