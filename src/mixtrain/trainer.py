"""Trainer.fit(): connect, start the workers, run the rounds, save the result. Glue only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from mixtrain import cluster, envinfo, preflight
from mixtrain._constants import BUCKET_MB, COLLECTIVE_TIMEOUT_S, RENDEZVOUS_TIMEOUT_S, env_float
from mixtrain.checkpoint import atomic_save
from mixtrain.comm.process_group import choose_backend
from mixtrain.comm.strategy import STRATEGIES
from mixtrain.config import RunConfig, ScalingConfig
from mixtrain.controller import Controller, EpochPlan
from mixtrain.data import to_arrays
from mixtrain.planner import largest_remainder, resolve_shares
from mixtrain.progress import ProgressView
from mixtrain.result import Result
from mixtrain.runlog import RunLog, make_run_dir
from mixtrain.task import Task
from mixtrain.worker_group import WorkerGroup


class Trainer:
    """Data-parallel training of one model over Ray workers, with the math of one big batch.

    Example::

        trainer = Trainer(make_task, (x, y), global_batch=64, eval_data=(x_test, y_test),
                          scaling=ScalingConfig(num_workers=2))
        result = trainer.fit(epochs=10)
    """

    worker_group_cls = WorkerGroup

    def __init__(
        self,
        task_factory: Callable[[], Task],
        train_data: Any,
        *,
        global_batch: int,
        eval_data: Any = None,
        scaling: ScalingConfig | None = None,
        run: RunConfig | None = None,
        strategy: str = "allreduce",
    ) -> None:
        if not callable(task_factory):
            raise TypeError(
                "task_factory must be a callable that returns mixtrain.Task(model=..., optimizer=..., loss_fn=...)"
            )
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch={global_batch!r}: must be an integer >= 1")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
        scaling = scaling or ScalingConfig()
        run = run or RunConfig()
        if not scaling.is_auto:  # check now; with groups="auto" the worker count comes from the cluster
            resolve_shares(scaling.shares, global_batch, scaling.num_workers)
        self.train_arrays = to_arrays(train_data)
        self.eval_arrays = to_arrays(eval_data) if eval_data is not None else None
        self.task_factory = task_factory
        self.global_batch = global_batch
        self.scaling = scaling
        self.run = run
        self.strategy = strategy

    def fit(self, epochs: int = 1) -> Result:
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs={epochs!r}: must be an integer >= 1")
        t_start = time.perf_counter()
        run_dir = make_run_dir(self.run)
        num_samples = len(self.train_arrays[0])
        view = ProgressView(False, 0)
        log: RunLog | None = None
        cluster.ensure_ray(self.scaling.address, _cpus_needed(self.scaling))
        group = self.worker_group_cls(self.scaling, self.run.seed)
        try:
            group.start()
            scaling = group.scaling  # resolved: groups="auto" became concrete groups
            workers, notes, backend, checks = self._set_up(group, scaling)
            shares = _shares_after_setup(scaling, self.global_batch, group)
            log = RunLog(
                run_dir,
                {
                    "scaling": scaling,
                    "run": self.run,
                    "global_batch": self.global_batch,
                    "epochs": epochs,
                    "strategy": self.strategy,
                    "backend": backend,
                    "shares": shares,
                    "num_samples": num_samples,
                },
            )
            log.write("workers", {"workers": workers})
            log.write("preflight", checks)
            view = ProgressView(self.run.progress, num_samples * epochs)
            view.log(
                f"mixtrain: {len(workers)} workers, global batch {self.global_batch} split {shares}, "
                f"{num_samples} samples x {epochs} epochs, {backend}; run folder {run_dir}"
            )
            view.log(device_table(workers))
            for note in notes:
                view.log(note)
            slowdown = scaling.slowdown()
            if slowdown:
                view.log(f"EMULATION: rank -> (times slower, from round) {slowdown} (MIXTRAIN_EMULATE_SLOWDOWN)")
            plan = EpochPlan(
                num_samples,
                self.global_batch,
                shares,
                self.run.steps_per_round,
                self.run.drift_tolerance,
                len(self.eval_arrays[0]) if self.eval_arrays else 0,
                balanced=scaling.balanced,
                max_micro_batch=list(scaling.max_micro_batch) if scaling.max_micro_batch else None,
                slowdown=slowdown,
            )
            controller = Controller(group, plan, log, view)
            to_first_step = time.perf_counter() - t_start
            controller.run(epochs)
            state = group.call("state_dict", timeout_s=env_float(COLLECTIVE_TIMEOUT_S), ranks=[0])[0]
        finally:
            view.close()
            group.shutdown()
            if log is not None:
                log.close()
        model_path = atomic_save(state, run_dir / "model.pt")
        view.log(f"done: weights in {model_path}")
        return Result(
            run_dir=run_dir,
            model_path=model_path,
            state_dict=state,
            history=controller.history,
            evals=controller.evals,
            workers=workers,
            seconds_to_first_step=to_first_step,
        )

    def _set_up(
        self, group: WorkerGroup, scaling: ScalingConfig
    ) -> tuple[list[dict[str, Any]], list[str], str, dict[str, Any]]:
        """Build replicas, check them, ship the data, form the group: each phase fails fast and names
        the worker. Returns the workers' info, notes for the user, the collective backend, and the
        preflight record (reports, numerics results, workers left out) for metrics.jsonl."""
        rendezvous_s = env_float(RENDEZVOUS_TIMEOUT_S)
        collective_s = env_float(COLLECTIVE_TIMEOUT_S)
        notes: list[str] = []
        checks: dict[str, Any] = {"reports": [], "numerics": [], "left_out": []}
        # Build before forming the group, so a factory that raises fails at once instead of
        # leaving its peers waiting out the rendezvous timeout.
        reports = group.call("build", self.task_factory, timeout_s=rendezvous_s + 600)
        checks["reports"] = reports
        preflight.check(envinfo.versions(), reports)
        train_ref = ray.put(self.train_arrays)  # once; workers read it zero-copy from the object store
        eval_ref = ray.put(self.eval_arrays) if self.eval_arrays is not None else None
        group.call("load_data", train_ref, eval_ref, timeout_s=rendezvous_s + 600)
        if scaling.numerics_check != "off":
            results = group.call("check_numerics", scaling.numerics_tolerance, timeout_s=rendezvous_s + 600)
            checks["numerics"] = results
            lines, bad = preflight.numerics_verdict(results, reports)
            notes += [f"numerics check: {line}" for line in lines]
            if bad and scaling.numerics_check == "strict":
                if len(bad) == len(reports):
                    raise preflight.PreflightError(
                        "numerics check (strict): every worker failed it:\n" + "\n".join(lines)
                    )
                group.drop(bad)
                checks["left_out"] = bad
                reports = [r for r in reports if r["rank"] not in bad]
                notes.append(f"numerics check (strict): left out worker(s) {bad}; the others were renumbered")
        backend = choose_backend(
            scaling.backend, [r["device"]["kind"] for r in reports], all(r["nccl"] for r in reports)
        )
        loss_scaling = any(r["precision"] == "fp16" for r in reports)
        host, port = group.call("open_rendezvous", rendezvous_s, timeout_s=rendezvous_s, ranks=[0])[0]
        bucket_bytes = int(env_float(BUCKET_MB) * 2**20)
        group.call(
            "join",
            host,
            port,
            rendezvous_s,
            collective_s,
            self.strategy,
            bucket_bytes,
            backend,
            loss_scaling,
            timeout_s=rendezvous_s + collective_s + 10,
        )
        return group.call("info", timeout_s=rendezvous_s), notes, backend, checks


def _cpus_needed(scaling: ScalingConfig) -> float:
    if scaling.is_auto:
        return 0.0
    return sum(g.resources()["CPU"] * g.num_workers for g in scaling.device_groups())


def _shares_after_setup(scaling: ScalingConfig, global_batch: int, group: WorkerGroup) -> list[int]:
    """Starting shares for the workers that are left: fixed shares lose the entries of workers
    that the numerics check left out and are rescaled to the global batch."""
    shares = scaling.shares
    n = group.num_workers
    if not isinstance(shares, str) and len(shares) != n:
        kept = [shares[s.rank] for s in group.specs]
        shares = largest_remainder([float(k) for k in kept], global_batch)
    return resolve_shares(shares, global_batch, n)


def device_table(workers: list[dict[str, Any]]) -> str:
    """One line per worker: where it runs, on what, at which precision."""
    lines = ["  worker  node             device                          precision  threads"]
    for w in workers:
        lines.append(
            f"  {w['rank']:>6}  {w['host']:<15}  {w['device_name'][:30]:<30}  {w['precision']:<9}  {w['threads']:>7}"
        )
    return "\n".join(lines)
