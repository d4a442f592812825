"""Peak resident memory per worker process: one plain process, torchrun DDP and mixtrain (every strategy),
side by side in one run; then the largest MLP that trains with every worker capped (cgroup v1 memory limit).

Command lines:
    make bench-memory                                          # both parts, one repeat (25 min on 2 cores)
    python benchmarks/memory.py --quick                        # smoke run: small models, one runner per kind
    python benchmarks/memory.py --repeats 3 --skip-fit-search  # peaks only, medians of 3
    python benchmarks/memory.py --workloads mlp-12m --runners ddp,mx:allreduce,mx:ps
    python benchmarks/memory.py --skip-peaks --cap-gb 1.5      # the fit search only (root: cgroup v1)
    python benchmarks/memory.py --runner mx:ps --width 2320    # one runner, prints one JSON line

Workloads: an MLP 784 -> W -> W -> W -> 10 (two W x W layers; W=2320: 12.6M parameters, W=4800: 49.9M), AdamW,
synthetic data made in each process (nothing downloaded), 24 steps of global batch 64. DDP and mixtrain run
2 workers x 32 samples x 1 thread. The plain process runs the whole batch of 64 on one thread: the same job on
one process, so its peak is what the job itself needs; the activations of 32 more samples are 32 x W floats per
layer (under 1 MB here), nothing next to the weights, so it is also the floor for one worker.

Runners: plain; ddp (torchrun --standalone, gloo, DistributedDataParallel with its defaults); mx:NAME for every
mixtrain strategy (StrategyConfig defaults: ps-async staleness 2, local-sgd H=8) with shares="equal", every worker
kept, 3 rounds of 8 steps and a checkpoint after each (checkpoint_every_s=0: two of them mid-run, counted in the
table); mx:allreduce+shard adds ScalingConfig(shard_optimizer=True) where this mixtrain has that option.

Measurement: each process reads its own high-water mark, VmHWM in /proc/self/status. Not ru_maxrss: it survives
exec, so a process started by a big parent reports the parent's peak. A daemon thread samples VmHWM every 50 ms
into <pid>.json in a folder the runner collects afterwards. The plain process and the DDP ranks take their last
reading themselves when training ends. In mixtrain, the task factory starts the thread in every process that
builds the model (the workers and the parameter-server shards); before the workers are stopped, the driver asks
every recorder for a last reading and waits for it (a WorkerGroup subclass whose shutdown does that first), so
the final state_dict is counted too. Result.workers maps pids to ranks; the driver's own peak is reported beside.
VmHWM counts every resident page: torch's shared library text and the pages of Ray's object store that the
process touched; each record's split_at_max_rss (raw results) splits the highest VmRSS sampled into RssAnon,
RssFile and RssShmem (the object store's pages). The thread also keeps VmRSS over time; matched with the run's
rounds and checkpoints (metrics.jsonl), they give the second table: where each mixtrain process's memory goes,
phase by phase.

Fits under a cap: every DDP rank and mixtrain worker moves itself into its own cgroup v1 memory group, a child of
this process's (/proc/self/cgroup), first thing (DDP: before importing torch; mixtrain: in the task factory).
This kernel no longer moves a process's existing charges with it, so the limit (memory and memory+swap) is the
cap minus the anonymous memory the process already holds: its whole anonymous memory stays under the cap.
Searched over the width W: doubling from --start-width until a trial fails, then --bisect-steps bisections
(multiples of 64). A trial runs FIT_STEPS steps (mixtrain: rounds of 2 steps, a checkpoint after every round) and
fits when it ends within FIT_TIMEOUT_S and no process was OOM-killed (memory.oom_control); mixtrain runs with
max_failures=0, no rejoin and MIXTRAIN_COLLECTIVE_TIMEOUT_S=20, so a killed worker ends the trial at once.
The cgroups are removed after every trial.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.compare import NUM_WORKERS  # noqa: E402  (the same pair as the speed benchmark)

BATCH_PER_WORKER = 32
GLOBAL_BATCH = BATCH_PER_WORKER * NUM_WORKERS
IN_FEATURES, NUM_CLASSES = 784, 10
WORKLOADS = {"mlp-12m": 2320, "mlp-50m": 4800}  # name: hidden width W
QUICK_WORKLOADS = {"mlp-1m": 512, "mlp-3m": 1024}
STEPS = 24
NUM_ROUNDS = 3  # mixtrain: a checkpoint after each round, so 2 of them mid-run
QUICK_STEPS = 9
FIT_STEPS = 4
STRATEGIES = ("allreduce", "ps", "ps-async", "local-sgd")
SHARD = "+shard"
RUNNERS = ("plain", "ddp", *(f"mx:{s}" for s in STRATEGIES), f"mx:allreduce{SHARD}")
QUICK_RUNNERS = ("plain", "ddp", "mx:allreduce", f"mx:allreduce{SHARD}")
FIT_RUNNERS = ("ddp", "mx:allreduce", f"mx:allreduce{SHARD}")
SAMPLE_S = 0.05
RSS_STEP_MB = 4.0
RSS_EVERY_S = 0.5
SPLIT = ("RssAnon", "RssFile", "RssShmem")  # the parts of VmRSS kept at its highest
FLUSH = "flush"  # a file in the record folder: every recorder takes its last reading
RECORDER_THREAD = "peak-rss-recorder"
FIT_TIMEOUT_S = 300
FIT_ENV = {"MIXTRAIN_COLLECTIVE_TIMEOUT_S": "20", "MIXTRAIN_LOST_GRACE_S": "5"}
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
PHASES = ("bring-up", "round 1", "later rounds", "checkpoints", "final state")
MAX_WIDTH = 65536
MIB = 2**20


# ---- the workload -------------------------------------------------------------------------------
def make_model(width: int):
    from torch import nn

    return nn.Sequential(
        nn.Linear(IN_FEATURES, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, NUM_CLASSES),
    )


def num_params(width: int) -> int:
    """make_model(width)'s parameter count, without building it."""
    return (IN_FEATURES + 1) * width + 2 * (width + 1) * width + (width + 1) * NUM_CLASSES


def make_optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_data(steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    n = steps * GLOBAL_BATCH
    return torch.randn((n, IN_FEATURES), generator=g), torch.randint(0, NUM_CLASSES, (n,), generator=g)


def train_steps(model, optimizer, x, y, lo: int, size: int, recorder: PeakRecorder) -> None:
    """The plain loop (the one process, each DDP rank): samples [lo, lo + size) of every global batch."""
    import torch

    for step in range(len(x) // GLOBAL_BATCH):
        start = step * GLOBAL_BATCH + lo
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[start : start + size]), y[start : start + size]).backward()
        optimizer.step()
        if step == 0:
            recorder.mark("first step")  # the optimizer's state exists from here on


# ---- measured from inside each process ----------------------------------------------------------
def status_fields(*fields: str) -> dict[str, float]:
    """Fields of this process's own /proc/self/status (VmHWM, VmRSS, RssAnon, ...), in MB, from one reading."""
    found: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in fields:
                found[name] = int(line.split()[1]) / 1024
    missing = [f for f in fields if f not in found]
    if missing:
        raise KeyError(missing[0])
    return found


def status_mb(field: str) -> float:
    """One field of this process's own /proc/self/status, in MB."""
    return status_fields(field)[field]


class PeakRecorder(threading.Thread):
    """Samples this process's VmHWM every SAMPLE_S into RECORD_DIR/<pid>.json: the peak, a timeline of its
    growth and the resident set at named points. A FLUSH file in the folder asks for a last reading."""

    def __init__(self, record_dir: str, role: str) -> None:
        super().__init__(name=RECORDER_THREAD, daemon=True)
        self.path = Path(record_dir) / f"{os.getpid()}.json"
        self.lock = threading.Lock()
        self.record: dict[str, Any] = {
            "pid": os.getpid(),
            "role": role,
            "peak_mb": 0.0,
            "marks": {"start": status_mb("VmRSS")},
            "timeline": [],  # (time, VmHWM) whenever it grew
            "rss": [],  # (time, VmRSS) whenever it moved by RSS_STEP_MB, and every RSS_EVERY_S
            "final": False,
            "split_at_max_rss": {},  # RssAnon / RssFile / RssShmem when VmRSS was at its most
        }

    def run(self) -> None:
        while not self.record["final"]:
            self.sample(final=(self.path.parent / FLUSH).exists())
            time.sleep(SAMPLE_S)

    def mark(self, name: str) -> None:
        """The resident set now, under `name` (e.g. "built": model and optimizer made)."""
        with self.lock:
            self.record["marks"][name] = status_mb("VmRSS")
        self.sample()

    def sample(self, final: bool = False) -> None:
        with self.lock:
            now, status = time.time(), status_fields("VmHWM", "VmRSS", *SPLIT)
            peak, rss = status["VmHWM"], status["VmRSS"]
            last = self.record["rss"][-1] if self.record["rss"] else (0.0, 0.0)
            if abs(rss - last[1]) >= RSS_STEP_MB or now - last[0] >= RSS_EVERY_S:
                self.record["rss"].append((now, rss))
            if rss >= self.record["split_at_max_rss"].get("VmRSS", 0.0):
                self.record["split_at_max_rss"] = {f: status[f] for f in ("VmRSS", *SPLIT)}
            grew = peak > self.record["peak_mb"]
            if grew:
                self.record["timeline"].append((now, peak))
                self.record["peak_mb"] = peak
            if grew or (final and not self.record["final"]):
                self.record["final"] = self.record["final"] or final
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.record))
                os.replace(tmp, self.path)  # the driver never reads half a file


def start_recorder(record_dir: str, role: str) -> PeakRecorder:
    """This process's recorder, started on the first call."""
    for thread in threading.enumerate():
        if thread.name == RECORDER_THREAD:
            return thread  # type: ignore[return-value]
    recorder = PeakRecorder(record_dir, role)
    recorder.sample()
    recorder.start()
    return recorder


def read_records(record_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in record_dir.glob("*.json")), key=lambda r: r["pid"])


def request_final_readings(record_dir: Path, wait_s: float = 5.0) -> None:
    """Ask every recorder in the folder for a last reading; wait until each has written it (a process that
    died never does: at most `wait_s`)."""
    (record_dir / FLUSH).touch()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(r["final"] for r in read_records(record_dir)):
        time.sleep(SAMPLE_S)


# ---- cgroup v1 memory limits (the fit search) ---------------------------------------------------
def own_memory_cgroup() -> Path:
    """This process's cgroup v1 memory folder, from /proc/self/cgroup (e.g. .../memory/process_api/<id>)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1 / path.lstrip("/")
    raise RuntimeError("no cgroup v1 memory controller in /proc/self/cgroup: skip the fit search (--skip-fit-search)")


def new_cgroup_parent() -> Path:
    """An unlimited group under ours, to hold one trial's per-process groups."""
    parent = own_memory_cgroup() / f"mixtrain-bench-memory-{os.getpid()}-{time.monotonic_ns()}"
    parent.mkdir()
    return parent


def join_cgroup(parent: str, cap_mb: float) -> None:
    """Move this process into its own group under `parent`, limited so its anonymous memory stays under
    cap_mb: what it held before stays charged to the old group, so the limit is the cap minus that."""
    me = Path(parent) / f"pid{os.getpid()}"
    if f"/{me.name}\n" in Path("/proc/self/cgroup").read_text():
        return  # joined already (a factory called twice)
    me.mkdir()
    limit = str(int((cap_mb - status_mb("RssAnon")) * MIB))
    (me / "memory.limit_in_bytes").write_text(limit)
    if (me / "memory.memsw.limit_in_bytes").exists():  # memory + swap: nothing swaps out of the cap
        (me / "memory.memsw.limit_in_bytes").write_text(limit)
    (me / "cgroup.procs").write_text(str(os.getpid()))


def cgroup_report(parent: Path) -> dict[str, dict[str, int]]:
    """Per process group: OOM kills and the peak charge (MB)."""
    out = {}
    for child in sorted(c for c in parent.iterdir() if c.is_dir()):
        oom = dict(line.split() for line in (child / "memory.oom_control").read_text().splitlines())
        peak = int((child / "memory.max_usage_in_bytes").read_text()) // MIB
        out[child.name] = {"oom_kill": int(oom.get("oom_kill", 0)), "max_usage_mb": peak}
    return out


def remove_cgroups(parent: Path, wait_s: float = 30.0) -> None:
    """Remove the trial's groups once their processes are gone; a straggler goes back to our own group."""
    children = [c for c in parent.iterdir() if c.is_dir()]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any((c / "cgroup.procs").read_text().strip() for c in children):
        time.sleep(0.2)
    for child in children:
        for pid in (child / "cgroup.procs").read_text().split():
            (parent.parent / "cgroup.procs").write_text(pid)
        child.rmdir()
    parent.rmdir()


# ---- runners, each in its own process -----------------------------------------------------------
def run_plain(args: argparse.Namespace, record_dir: Path) -> dict:
    recorder = start_recorder(str(record_dir), "process")
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = make_data(args.steps)
    model = make_model(args.width)
    optimizer = make_optimizer(model)
    recorder.mark("built")
    train_steps(model, optimizer, x, y, 0, GLOBAL_BATCH, recorder)
    recorder.sample(final=True)
    return {}


def run_ddp_rank(args: argparse.Namespace) -> None:
    if args.cgroup:
        join_cgroup(args.cgroup, args.cap_mb)  # before torch is imported: all it loads counts
    recorder = start_recorder(args.record_dir, f"rank {os.environ['RANK']}")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = make_data(args.steps)
    model = DistributedDataParallel(make_model(args.width))
    optimizer = make_optimizer(model)
    recorder.mark("built")
    train_steps(model, optimizer, x, y, dist.get_rank() * BATCH_PER_WORKER, BATCH_PER_WORKER, recorder)
    recorder.sample(final=True)
    dist.destroy_process_group()


def run_ddp(args: argparse.Namespace, record_dir: Path) -> dict:
    rank_args = ["--width", str(args.width), "--steps", str(args.steps), "--record-dir", str(record_dir)]
    if args.cgroup:
        rank_args += ["--cgroup", args.cgroup, "--cap-mb", str(args.cap_mb)]
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NUM_WORKERS}"),
        *(__file__, "--runner", "ddp-rank", *rank_args),
    ]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {}


def run_mixtrain(args: argparse.Namespace, record_dir: Path) -> dict:
    import ray

    from mixtrain import RunConfig, ScalingConfig, StrategyConfig, Trainer

    spec = args.runner.removeprefix("mx:")
    fit_trial = args.cgroup is not None
    factory = functools.partial(_mixtrain_task, args.width, str(record_dir), args.cgroup, args.cap_mb)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            factory,
            make_data(args.steps),
            global_batch=GLOBAL_BATCH,
            scaling=ScalingConfig(
                num_workers=NUM_WORKERS,
                shares="equal",
                leave_out_slow=False,
                **({"shard_optimizer": True} if spec.endswith(SHARD) else {}),
            ),
            run=RunConfig(
                run_dir=run_dir,
                progress=False,
                steps_per_round=2 if fit_trial else max(1, args.steps // NUM_ROUNDS),
                checkpoint_every_s=0,  # after every round
                max_failures=0,
                rejoin=False,
            ),
            strategy=StrategyConfig(name=spec.removesuffix(SHARD)),
        )
        trainer.worker_group_cls = _flushing_group(record_dir)
        result = trainer.fit(epochs=1)
        events = read_events(Path(run_dir))
    ray.shutdown()
    return {
        "ranks": {str(w["pid"]): w["rank"] for w in result.workers},
        "events": events,
        "driver_peak_mb": status_mb("VmHWM"),
    }


def _mixtrain_task(width: int, record_dir: str, cgroup: str | None, cap_mb: float):
    """The task factory: runs in every process that builds the model (workers and parameter-server shards)."""
    import torch

    from mixtrain import Task

    if cgroup:
        join_cgroup(cgroup, cap_mb)
    recorder = start_recorder(record_dir, "mixtrain")
    model = make_model(width)
    task = Task(model=model, optimizer=make_optimizer(model), loss_fn=torch.nn.functional.cross_entropy)
    recorder.mark("built")
    return task


def _flushing_group(record_dir: Path) -> type:
    """mixtrain's WorkerGroup, whose shutdown first collects every recorder's last reading (the workers are
    killed right after it, and the final state_dict has just been taken)."""
    from mixtrain.group.worker_group import WorkerGroup

    class FlushingGroup(WorkerGroup):
        def shutdown(self, quick: bool = False, finished: bool = False) -> None:
            request_final_readings(record_dir)
            super().shutdown(quick, finished)

    return FlushingGroup


def read_events(run_dir: Path) -> list[dict]:
    """The run's rounds (start, end) and checkpoints (saved at `end`) from metrics.jsonl, in time order."""
    events = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "round":
            events.append({"kind": "round", "start": r["time"] - r["wall_s"], "end": r["time"]})
        elif r["kind"] == "checkpoint":
            events.append({"kind": "checkpoint", "end": r["time"], "mid_run": r["step"] > 0})
    return events


def run_one(args: argparse.Namespace) -> dict:
    """One runner in this process; what each of its processes recorded, labelled by role."""
    runners = {"plain": run_plain, "ddp": run_ddp}
    run = run_mixtrain if args.runner.startswith("mx:") else runners[args.runner]
    with tempfile.TemporaryDirectory() as tmp:
        out = run(args, Path(tmp))
        records = read_records(Path(tmp))
    ranks = out.pop("ranks", None)
    if ranks is not None:  # mixtrain: a process that built the model is a worker, or else a parameter server
        servers = iter(range(len(records)))
        for r in records:  # in pid order: the servers in the order they started
            r["role"] = f"worker {ranks[str(r['pid'])]}" if str(r["pid"]) in ranks else f"ps server {next(servers)}"
    return {"runner": args.runner, "width": args.width, "params": num_params(args.width), "records": records, **out}


# ---- the memory table ---------------------------------------------------------------------------
def run_subprocess(runner: str, width: int, steps: int, cap: tuple[Path, float] | None = None) -> dict:
    """A runner in its own process, started as a user would; its JSON line, or {"error": ...} (killed with its
    process group after FIT_TIMEOUT_S)."""
    cmd = [sys.executable, __file__, "--runner", runner, "--width", str(width), "--steps", str(steps)]
    env = dict(os.environ)
    if cap is not None:
        cmd += ["--cgroup", str(cap[0]), "--cap-mb", str(cap[1])]
        env.update(FIT_ENV)
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=FIT_TIMEOUT_S if cap else None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {FIT_TIMEOUT_S} s"}
    if proc.returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return {"error": f"exit {proc.returncode}: {last[:300]}", "stderr": stderr[-3000:]}
    return json.loads(stdout.strip().splitlines()[-1])


def peaks_of(out: dict) -> dict[str, Any]:
    """Per-worker peaks in rank order, the other processes' (ps servers), the driver's, and RSS once built."""
    workers = sorted((r for r in out["records"] if not r["role"].startswith("ps")), key=lambda r: r["role"])
    servers = [r for r in out["records"] if r["role"].startswith("ps")]
    return {
        "workers": [r["peak_mb"] for r in workers],
        "servers": [r["peak_mb"] for r in servers],
        "driver": out.get("driver_peak_mb"),
        "built": [r["marks"].get("built", 0.0) for r in workers],
        "mid_run_checkpoints": sum(e.get("mid_run", False) for e in out.get("events", [])),
    }


def phase_at(t: float, events: list[dict]) -> str:
    """Which part of a mixtrain run the time `t` falls in (to within one 50 ms sample)."""
    rounds = [e for e in events if e["kind"] == "round"]
    if not rounds or t < rounds[0]["start"]:
        return "bring-up"
    following = next((e for e in events if t <= e["end"]), None)
    if following is None:
        return "final state"
    if following["kind"] == "checkpoint":
        return "checkpoints"
    return "round 1" if following is rounds[0] else "later rounds"


def phases_of(record: dict, events: list[dict]) -> dict[str, Any]:
    """One mixtrain process: VmHWM when the factory ran, then per phase the most VmRSS sampled in it (the level
    it came in with counts) and how much the phase raised VmHWM."""
    rss_max = dict.fromkeys(PHASES, 0.0)
    level = 0.0
    for t, rss in record["rss"]:
        phase = phase_at(t, events)
        rss_max[phase] = max(rss_max[phase], rss, level)
        level = rss
    grew = dict.fromkeys(PHASES, 0.0)
    for (_, before), (t, after) in itertools.pairwise(record["timeline"]):
        grew[phase_at(t, events)] += after - before
    return {"at factory": record["timeline"][0][1], "rss_max": rss_max, "grew": grew, "peak": record["peak_mb"]}


def median_of(items: list[Any]) -> Any:
    """Elementwise median of equally shaped numbers, lists and dicts (one per repeat)."""
    first = items[0]
    if isinstance(first, dict):
        return {k: median_of([i[k] for i in items]) for k in first}
    if isinstance(first, list):
        return [median_of(list(col)) for col in zip(*items)]
    return None if first is None else statistics.median(items)


def measure_peaks(workloads: dict[str, int], runners: list[str], steps: int, repeats: int) -> dict:
    results: dict = {}
    for rep in range(repeats):
        for workload, width in workloads.items():
            for runner in runners:
                out = run_subprocess(runner, width, steps)
                if "error" in out:
                    raise RuntimeError(f"{runner} on {workload} failed: {out['error']}\n{out.get('stderr', '')}")
                results.setdefault(workload, {}).setdefault(runner, []).append(out)
                peaks = peaks_of(out)
                shown = " / ".join(f"{p:,.0f}" for p in peaks["workers"])
                print(f"  [{rep + 1}/{repeats}] {workload} {runner:20s} {shown} MB", file=sys.stderr, flush=True)
    return results


def mb(values: list[float]) -> str:
    return " / ".join(f"{v:,.0f}" for v in values) or "-"


def peak_table(results: dict) -> str:
    lines = [
        "| workload | params | runner | per-worker peak MB | max | vs DDP max | RSS once built | driver MB "
        "| ps servers MB | mid-run ckpts |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, by_runner in results.items():
        med = {runner: median_of([peaks_of(o) for o in outs]) for runner, outs in by_runner.items()}
        ddp_max = max(med["ddp"]["workers"]) if "ddp" in med else None
        for runner, p in med.items():
            top = max(p["workers"])
            cells = [
                workload,
                f"{by_runner[runner][0]['params'] / 1e6:.1f}M",
                runner,
                mb(p["workers"]),
                mb([top]),
                f"{top / ddp_max:.2f}x" if ddp_max else "-",
                mb(p["built"]),
                mb([p["driver"]] if p["driver"] else []),
                mb(p["servers"]),
                f"{p['mid_run_checkpoints']:.0f}" if runner.startswith("mx:") else "-",
            ]
            lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def phase_cell(rss_max: float, grew: float) -> str:
    return f"{rss_max:,.0f} (+{grew:,.0f})" if rss_max else "-"  # no sample: a short phase, RSS flat


def phase_table(results: dict) -> str:
    lines = [
        "Where mixtrain's memory goes, per process: VmHWM when the task factory ran; per phase, the most VmRSS "
        "sampled in it and in brackets what it added to VmHWM (once a phase has raised VmHWM, later phases show only "
        "what they add above it; -: no sample in that phase); MB",
        f"| workload | runner | process | at factory | {' | '.join(PHASES)} | peak |",
        "|---|---|---|" + "---:|" * (len(PHASES) + 2),
    ]
    for workload, by_runner in results.items():
        for runner, outs in by_runner.items():
            if not runner.startswith("mx:"):
                continue
            per_run = [{r["role"]: phases_of(r, o["events"]) for r in o["records"]} for o in outs]
            for role, p in sorted(median_of(per_run).items()):
                cells = [phase_cell(p["rss_max"][ph], p["grew"][ph]) for ph in PHASES]
                lines.append(
                    f"| {workload} | {runner} | {role} | {p['at factory']:,.0f} | {' | '.join(cells)} "
                    f"| {p['peak']:,.0f} |"
                )
    return "\n".join(lines)


# ---- the largest model that fits under a cap ----------------------------------------------------
def trial(runner: str, width: int, cap_mb: float) -> dict:
    """One run of FIT_STEPS steps with every worker capped; did it fit?"""
    parent = new_cgroup_parent()
    t = time.perf_counter()
    try:
        out = run_subprocess(runner, width, FIT_STEPS, cap=(parent, cap_mb))
        groups = cgroup_report(parent)
    finally:
        remove_cgroups(parent)
    killed = sum(g["oom_kill"] for g in groups.values())
    why = f"OOM-killed ({killed})" if killed else out.get("error", "ok")
    return {
        "width": width,
        "params": num_params(width),
        "fits": why == "ok",
        "why": why,
        "seconds": round(time.perf_counter() - t, 1),
        "max_usage_mb": [g["max_usage_mb"] for g in groups.values()],
    }


def largest_fitting(runner: str, cap_mb: float, start_width: int, bisect_steps: int) -> dict:
    """Doubling (or halving) from start_width to a bracket [fits, fails], then bisection in multiples of 64."""
    trials: list[dict] = []

    def fits(width: int) -> bool:
        trials.append(trial(runner, width, cap_mb))
        t = trials[-1]
        print(f"  fit {runner:20s} W={width:5d} ({t['params'] / 1e6:5.1f}M): {t['why']} ({t['seconds']} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        return t["fits"]

    lo, hi, width = 0, 0, start_width
    while 64 <= width <= MAX_WIDTH and not (lo and hi):
        if fits(width):
            lo, width = width, width * 2
        else:
            hi, width = width, width // 2
    for _ in range(bisect_steps if lo else 0):
        mid = (lo + hi) // 2 // 64 * 64
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"runner": runner, "cap_mb": cap_mb, "width": lo, "params": num_params(lo) if lo else 0, "trials": trials}


def fit_table(fits: list[dict], cap_mb: float) -> str:
    ddp = next((f["params"] for f in fits if f["runner"] == "ddp"), 0)
    lines = [
        f"Largest MLP that trains {FIT_STEPS} steps with each of {NUM_WORKERS} workers capped at {cap_mb:,.0f} MB "
        "(cgroup v1)",
        "| runner | width | parameters | vs DDP | trials (width: result) |",
        "|---|---:|---:|---:|---|",
    ]
    for f in fits:
        vs = f"{f['params'] / ddp:.2f}x" if ddp else "-"
        tried = ", ".join(f"{t['width']}: {'fits' if t['fits'] else t['why'][:40]}" for t in f["trials"])
        lines.append(f"| {f['runner']} | {f['width']} | {f['params'] / 1e6:.1f}M | {vs} | {tried} |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------
def has_shard_optimizer() -> bool:
    from mixtrain.config import ScalingConfig

    return "shard_optimizer" in {f.name for f in dataclasses.fields(ScalingConfig)}


def available(runners: list[str]) -> list[str]:
    """The runners this mixtrain can run: +shard only where ScalingConfig has shard_optimizer."""
    if has_shard_optimizer():
        return runners
    for runner in (r for r in runners if r.endswith(SHARD)):
        print(f"{runner}: skipped (no shard_optimizer in this mixtrain)", flush=True)
    return [r for r in runners if not r.endswith(SHARD)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: small models, one runner per kind")
    parser.add_argument("--workloads", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--runners", help=f"comma-separated, of {', '.join(RUNNERS)}")
    parser.add_argument("--repeats", type=int, default=1, help="medians over this many runs of each")
    parser.add_argument("--skip-peaks", action="store_true", help="only the fit search")
    parser.add_argument("--skip-fit-search", action="store_true")
    parser.add_argument("--cap-gb", type=float, default=1.5, help="the per-worker memory cap of the fit search")
    parser.add_argument("--start-width", type=int, default=2048)
    parser.add_argument("--bisect-steps", type=int, help="after the doubling; default 3 (--quick: 0)")
    parser.add_argument("--json", default="bench_results/memory.json", help="where the raw results go")
    parser.add_argument("--runner", help="run one runner in this process (prints one JSON line)")
    parser.add_argument("--width", type=int, default=WORKLOADS["mlp-12m"], help="(--runner) the MLP width")
    parser.add_argument("--steps", type=int, default=STEPS, help="(--runner) training steps")
    parser.add_argument("--record-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--cap-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.runner == "ddp-rank":
        run_ddp_rank(args)
        return
    if args.runner:
        print(json.dumps(run_one(args)))
        return
    workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.workloads:
        workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    steps = QUICK_STEPS if args.quick else STEPS
    started = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"mixtrain memory benchmark, {started}; parameters: "
          + ", ".join(f"{w} (W={n}) {num_params(n):,}" for w, n in workloads.items()), flush=True)  # fmt: skip
    raw: dict[str, Any] = {"started": started, "args": vars(args), "steps": steps}
    if not args.skip_peaks:
        runners = available(args.runners.split(",") if args.runners else list(QUICK_RUNNERS if args.quick else RUNNERS))
        raw["peaks"] = measure_peaks(workloads, runners, steps, args.repeats)
        print(peak_table(raw["peaks"]), flush=True)
        print(phase_table(raw["peaks"]), flush=True)
    if not args.skip_fit_search:
        cap_mb = args.cap_gb * 1024
        bisect_steps = args.bisect_steps if args.bisect_steps is not None else 0 if args.quick else 3
        raw["fit"] = [
            largest_fitting(runner, cap_mb, args.start_width, bisect_steps) for runner in available(list(FIT_RUNNERS))
        ]
        print(fit_table(raw["fit"], cap_mb), flush=True)
    raw["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(raw, indent=1))
    print(f"raw results: {args.json} (finished {raw['finished']})")


if __name__ == "__main__":
    main()
