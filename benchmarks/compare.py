"""mixtrain vs torchrun DDP vs Ray Train vs one process, on the same workloads, in one run.

Command lines:
    make bench                                             # everything, medians of 3
    python benchmarks/compare.py --repeats 1 --workloads cnn
    python benchmarks/compare.py --runner mixtrain --workload mlp   # one runner, prints one JSON line
    python benchmarks/compare.py --runners single1,mixtrain1 --repeats 5   # mixtrain's own cost per step (us)
    python benchmarks/compare.py --runners single1,mixtrain1 --workloads deep   # the same on a step of many small
        # operations (24 layers of width 16), launch-bound as a small model's step on a GPU
    python benchmarks/compare.py --runners single,mixtrain,mixtrain-default --repeats 3   # the first run's default
        # (mixtrain-default: no --workers, i.e. auto: one CPU worker holding every core here) against the plain loop
    python benchmarks/compare.py --emulate 1:3 --runners single1,ddp,mixtrain,mixtrain-all,mixtrain-equal
        # EMULATION: worker 1 computes 3x slower in DDP and mixtrain (mixtrain: default, which may leave
        # a worker out; balanced with every worker kept; fixed equal split);
        # "ideal" = one worker alone + the slow worker alone = single1 x (1 + 1/3)
    python benchmarks/compare.py --runners ddp-sliced,ddp,mixtrain-all --workloads mlp,cnn   # DDP at its cheapest
        # (ddp-sliced: each rank reads a contiguous slice of the tensors, a view, where every other runner gathers
        # its samples from the epoch's permutation)
    python benchmarks/compare.py --runners ddp,raytrain,mixtrain-all,mxloop --workloads mlp,cnn   # your own loop
        # (mxloop: the same step loop through mixtrain.train's prepare_model and prepare_data_loader)
    python benchmarks/compare.py --runners ddp,mxrun --workloads mlp,cnn   # the command against the command:
        # `mixtrain run compare.py --workers 2 -- ARGS` against `python -m torch.distributed.run ... compare.py`
    python benchmarks/compare.py --workloads newcomer --runners single,single1,mxloop1,mxloop-default,mxloop,mixtrain1
        # the newcomer's script (issue 45): a CNN on scikit-learn's digits, a Dataset that is not a TensorDataset,
        # DataLoader(batch_size=64, num_workers=1, shuffle=True), 8 epochs; the whole loop timed, as its author
        # would time it (loader starts included); mxloop1: one worker through the loop API, mxloop: two,
        # mxloop-default: the default (one worker holding every core here), mixtrain1: the Task door
    python benchmarks/compare.py --runners ddp,mixtrain-all,mxrun --workloads mlp --beside-ray
        # the same with a second embedded Ray idling on the machine all along (another run at once, a `ray start`
        # cluster, a test session): what a run's start finds when it is not alone
    python benchmarks/compare.py --emulate 1:3@4 --runners mixtrain-all --workloads cnn --repeats 1
        # a slowdown switched on at round 4: prints mixtrain's shares per round
    python benchmarks/compare.py --workloads cnn --emulate 1:3 --runners ddp,mx:allreduce,mx:ps,mx:ps-async,\
mx:local-sgd,mx:allreduce+bf16,mx:ps+bf16,mx:ps-async+bf16,mx:local-sgd+bf16
        # mixtrain's strategies ("mx:NAME[+bf16]": every worker kept; ps-async with staleness 2,
        # local-sgd with H=8); the link-limited comparison is benchmarks/slow_link.py

Emulation rule, the same in every runner: a slow rank sleeps (factor - 1) x the plain compute
time of its samples where no collective overlaps the sleep (DDP and Ray Train: before each step,
on a timing of its fixed slice calibrated once at start, since their exchange runs inside the
backward pass; mixtrain: after each step's forward and backward and before its exchange, on
their measured time, which includes the all-reduces its backward starts).

Every runner is its own subprocess, started the way a user would start it, so "first step"
is the wall time from the command starting to the first training step. Workloads use
synthetic data, global batch 128, SGD with momentum; distributed runners use 2 workers
x 1 thread, the single process 2 threads. samples/s excludes warm-up steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

T0_ENV = "MIXTRAIN_BENCH_T0"
GLOBAL_BATCH = 128
NUM_WORKERS = 2
WORKLOADS = {
    # name: (samples per epoch, epochs, warm-up steps excluded from samples/s)
    "mlp": (128 * 100, 4, 40),
    "cnn": (128 * 30, 2, 6),
    "deep": (128 * 100, 4, 40),  # 24 layers of width 16: a step of many small ops, as a GPU step is launch-bound
    "newcomer": (1438, 8, 0),  # scikit-learn's digits less a held-out fifth; the whole loop is timed
}
NEWCOMER_BATCH = 64  # the newcomer's DataLoader(batch_size=64): the global batch on every runner
RUNNERS = ("single", "ddp", "raytrain", "mixtrain")
EMULATE_ENV = "MIXTRAIN_EMULATE_SLOWDOWN"  # the same variable mixtrain's workers read
PRESLICED_ENV = "MIXTRAIN_BENCH_PRESLICED"  # ddp-sliced: the ranks read contiguous slices (views), no gather


def t0() -> float:
    return float(os.environ.get(T0_ENV, time.time()))


def make_model(workload: str):
    from torch import nn

    if workload == "mlp":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    if workload == "deep":
        return nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(16, 16), nn.ReLU())], nn.Linear(16, 10))
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(9216, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_data(workload: str):
    import torch

    n = WORKLOADS[workload][0]
    g = torch.Generator().manual_seed(0)
    shape = {"mlp": (n, 784), "deep": (n, 16)}.get(workload, (n, 1, 28, 28))
    return torch.randn(shape, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_optimizer(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def slowdown_for(rank: int) -> float:
    from mixtrain.config import parse_slowdown

    return parse_slowdown(os.environ.get(EMULATE_ENV, "")).get(rank, (1.0, 0))[0]


def calibrate_step_s(workload: str, local: int) -> float:
    """Median plain forward+backward time of `local` samples: what an emulated slow rank sleeps on."""
    import torch

    torch.manual_seed(0)
    model = make_model(workload)
    x, y = make_data(workload)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x[:local]), y[:local]).backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def timed_loop(model, opt, x, y, workload: str, rank: int, world: int) -> dict:
    """A plain step loop (used by single, DDP and Ray Train): this rank's slice of each global batch, the
    samples in a seeded random order per epoch (as mixtrain, and any real training, reads them: a gather, not
    a contiguous slice). Under EMULATION a slow rank sleeps (factor - 1) x its calibrated compute before each
    step."""
    import torch

    n, epochs, warmup = WORKLOADS[workload]
    local = GLOBAL_BATCH // world
    loss_fn = torch.nn.functional.cross_entropy
    factor = slowdown_for(rank) if world > 1 else 1.0
    sleep_s = (factor - 1.0) * calibrate_step_s(workload, local) if factor > 1 else 0.0
    first_step = time.time() - t0()
    steps, t_measure = 0, 0.0
    presliced = os.environ.get(PRESLICED_ENV) == "1"
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
        for start in range(0, n, GLOBAL_BATCH):
            if steps == warmup:
                t_measure = time.perf_counter()
            begin = start + rank * local
            idx = slice(begin, begin + local) if presliced else order[begin : begin + local]
            if sleep_s:
                time.sleep(sleep_s)
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            steps += 1
    elapsed = time.perf_counter() - t_measure
    return {"samples_per_s": (steps - warmup) * GLOBAL_BATCH / elapsed, "first_step_s": first_step, "steps": steps}


# ---- runners (each in its own process) ---------------------------------------------------------
def run_single(workload: str, threads: int = NUM_WORKERS) -> dict:
    import torch

    torch.set_num_threads(threads)
    if workload == "newcomer":
        return newcomer_plain()
    torch.manual_seed(0)
    model = make_model(workload)
    x, y = make_data(workload)
    return timed_loop(model, make_optimizer(model), x, y, workload, 0, 1)


def run_ddp_rank(workload: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(workload))
    x, y = make_data(workload)
    out = timed_loop(model, make_optimizer(model), x, y, workload, dist.get_rank(), dist.get_world_size())
    dist.destroy_process_group()
    return out


def run_ddp(workload: str, presliced: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={NUM_WORKERS}",
            __file__,
            "--runner",
            "ddp-rank",
            "--workload",
            workload,
            "--out",
            str(out_file),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", PRESLICED_ENV: "1" if presliced else "0"}
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        return json.loads(out_file.read_text())


def run_raytrain(workload: str) -> dict:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "out.json"

        def loop(config: dict) -> None:
            import torch
            from ray import train
            from ray.train.torch import prepare_model

            torch.set_num_threads(1)
            torch.manual_seed(0)
            model = prepare_model(make_model(workload))
            x, y = make_data(workload)
            ctx = train.get_context()
            out = timed_loop(model, make_optimizer(model), x, y, workload, ctx.get_world_rank(), ctx.get_world_size())
            if ctx.get_world_rank() == 0:
                Path(config["out"]).write_text(json.dumps(out))

        # workers at nice 0 as mixtrain's and torchrun's: at Ray's default 15 a loaded machine starves them
        ray.init(
            num_cpus=NUM_WORKERS + 1,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            _system_config={"worker_niceness": 0},
        )
        TorchTrainer(
            loop,
            train_loop_config={"out": str(out_file)},
            scaling_config=ScalingConfig(num_workers=NUM_WORKERS, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=tmp, name="bench"),
        ).fit()
        ray.shutdown()
        return json.loads(out_file.read_text())


def run_mixtrain(
    workload: str,
    shares: str = "auto",
    keep_all: bool = False,
    strategy: str = "allreduce",
    workers: int | None = NUM_WORKERS,
) -> dict:
    """`workers=None`: ScalingConfig's default (auto: on a CPU-only machine one worker holding every core)."""
    import functools

    from mixtrain import LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig, Trainer

    name, _, compress = strategy.partition("+")
    if workload == "newcomer":
        return newcomer_task(workers)

    x, y = make_data(workload)
    n, epochs, warmup = WORKLOADS[workload]
    t_fit = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result = Trainer(
            functools.partial(_mixtrain_task, workload),
            (x, y),
            global_batch=GLOBAL_BATCH,
            scaling=ScalingConfig(num_workers=workers, shares=shares, leave_out_slow=not keep_all),  # type: ignore[arg-type]
            run=RunConfig(run_dir=tmp, progress=False),
            strategy=StrategyConfig(
                name=name,
                compress=compress or "none",
                ps=PSConfig(staleness=2),
                local_sgd=LocalSGDConfig(local_steps=8),
            ),
        ).fit(epochs=epochs)
    steps_per_epoch = n // GLOBAL_BATCH
    measured = [r for r in result.history if r["epoch"] * steps_per_epoch + r["first_step"] >= warmup]
    samples = sum(r["samples"] for r in measured)
    wall = sum(r["wall_s"] for r in measured)
    workers = measured[-1]["workers"]
    return {
        "samples_per_s": samples / wall,
        "first_step_s": t_fit + result.seconds_to_first_step - t0(),
        "steps": sum(r["num_steps"] for r in result.history),
        "compute_share": sum(w["compute_s"] for w in workers) / (len(workers) * measured[-1]["wall_s"]),
        "final_shares": result.history[-1]["shares"],
        "shares_per_round": [r["shares"] for r in result.history],
        "workers_used": len(result.workers),
    }


def run_mxloop(workload: str, shares: str = "auto", workers: int | None = NUM_WORKERS) -> dict:
    """The same step loop as DDP's and Ray Train's, through mixtrain's loop API (mixtrain.train): prepare_model,
    prepare_data_loader over the same tensors (batch_size = the global batch / the workers), the shares following
    measured speed at each epoch's start. Rank 0 times the steps after the warm-up."""
    from mixtrain.train import RunConfig, ScalingConfig
    from mixtrain.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "out.json"
        result = TorchTrainer(
            _newcomer_mxloop if workload == "newcomer" else _mxloop,
            train_loop_config={"workload": workload, "out": str(out_file)},
            scaling_config=ScalingConfig(num_workers=workers, shares=shares),  # type: ignore[arg-type]
            run_config=RunConfig(storage_path=tmp, progress=False),
        ).fit()
        out = json.loads(out_file.read_text())
    out["workers_used"] = len(result.workers)  # (the table said 2 for mxloop1)
    return out


def run_mxrun(workload: str) -> dict:
    """The same loop as `mxloop`, started the way a torchrun user starts their script: `mixtrain run compare.py
    --workers 2 -- ARGS` (its rank code is `mxrun-rank`), against `python -m torch.distributed.run ... compare.py`
    (ddp). The command's whole start is in its first step: the CLI, Ray, the workers, the script on each."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "out.json"
        script_args = ["--runner", "mxrun-rank", "--workload", workload, "--out", str(out_file)]
        mixtrain_cli = Path(sys.executable).parent / "mixtrain"
        cmd = [str(mixtrain_cli), "run", __file__, "--workers", str(NUM_WORKERS), "--quiet", "--run-dir", tmp + "/run"]
        subprocess.run([*cmd, "--", *script_args], check=True, capture_output=True)
        return json.loads(out_file.read_text())


def _mxloop(config: dict) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import mixtrain.train
    from mixtrain.train.torch import prepare_data_loader, prepare_model

    workload = config["workload"]
    _, epochs, warmup = WORKLOADS[workload]
    torch.manual_seed(0)
    model = prepare_model(make_model(workload))
    opt = make_optimizer(model)
    x, y = make_data(workload)
    batch = GLOBAL_BATCH // mixtrain.train.get_context().get_world_size()
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True))
    first_step = time.time() - t0()
    steps, t_measure = 0, 0.0
    for _ in range(epochs):
        for xb, yb in loader:
            if steps == warmup:
                t_measure = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps += 1
    elapsed = time.perf_counter() - t_measure
    if mixtrain.train.get_context().get_world_rank() == 0:
        out = {"samples_per_s": (steps - warmup) * GLOBAL_BATCH / elapsed, "first_step_s": first_step, "steps": steps}
        Path(config["out"]).write_text(json.dumps(out))


def _mixtrain_task(workload: str):
    import torch

    from mixtrain import Task

    model = make_model(workload)
    return Task(model=model, optimizer=make_optimizer(model), loss_fn=torch.nn.functional.cross_entropy)


# ---- the newcomer's script (issue 45 item 6, issue 49) -----------------------------------------------
class DigitsImages:
    """The newcomer's Dataset (a map-style one that is not a TensorDataset): scikit-learn's digits less a held-out
    fifth, one (image, label) per index."""

    def __init__(self) -> None:
        from mixtrain.examples.digits import load_digits

        (self.x, self.y), _ = load_digits()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def newcomer_epochs(model, opt, loader, device) -> tuple[float, float]:
    """The newcomer's loop, 8 epochs; returns its seconds (loader starts included, as its author timed it) and the
    CPU seconds this process and its loader processes spent in it (steadier than the wall on a loaded machine)."""
    import torch

    t, cpu = time.perf_counter(), _cpu_s()
    for _ in range(WORKLOADS["newcomer"][1]):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return time.perf_counter() - t, _cpu_s() - cpu


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children (loader processes end with their epoch)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _newcomer_out(loop: tuple[float, float], first_step_s: float) -> dict:
    n, epochs, _ = WORKLOADS["newcomer"]
    return {"samples_per_s": n * epochs / loop[0], "first_step_s": first_step_s, "loop_s": loop[0], "cpu_s": loop[1]}


def newcomer_plain() -> dict:
    """The script alone: DataLoader(batch_size=64, num_workers=1, shuffle=True)."""
    import torch
    from torch.utils.data import DataLoader

    from mixtrain.examples.digits import DigitsCNN

    torch.manual_seed(0)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    loader = DataLoader(DigitsImages(), batch_size=NEWCOMER_BATCH, num_workers=1, shuffle=True)
    first_step = time.time() - t0()
    return _newcomer_out(newcomer_epochs(model, opt, loader, torch.device("cpu")), first_step)


def _newcomer_mxloop(config: dict) -> None:
    """The script through the loop API: its loader's batch_size is the global batch over the workers (the math
    of the plain script)."""
    import torch
    from torch.utils.data import DataLoader

    import mixtrain.train
    from mixtrain.examples.digits import DigitsCNN
    from mixtrain.train.torch import prepare_data_loader, prepare_model

    ctx = mixtrain.train.get_context()
    torch.manual_seed(0)
    model = prepare_model(DigitsCNN())
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    batch = NEWCOMER_BATCH // ctx.get_world_size()
    loader = prepare_data_loader(DataLoader(DigitsImages(), batch_size=batch, num_workers=1, shuffle=True))
    first_step = time.time() - t0()
    loop_s = newcomer_epochs(model, opt, loader, mixtrain.train.get_device())
    if ctx.get_world_rank() == 0:
        Path(config["out"]).write_text(json.dumps(_newcomer_out(loop_s, first_step)))


def newcomer_task(workers: int | None) -> dict:
    """The same model, data and loader processes through the Task door (samples/s over the rounds' wall time)."""
    from mixtrain import RunConfig, ScalingConfig, Trainer
    from mixtrain.data import Loader
    from mixtrain.examples.digits import make_task

    t_fit = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        result = Trainer(
            make_task,
            Loader(dataset=DigitsImages(), num_workers=1),
            global_batch=NEWCOMER_BATCH,
            scaling=ScalingConfig(num_workers=workers),  # type: ignore[arg-type]
            run=RunConfig(run_dir=tmp, progress=False),
        ).fit(epochs=WORKLOADS["newcomer"][1])
    samples = sum(r["samples"] for r in result.history)
    out = _newcomer_out((1.0, 0.0), t_fit + result.seconds_to_first_step - t0())
    del out["loop_s"], out["cpu_s"]  # not timed here: the rounds' wall time is
    out["samples_per_s"] = samples / sum(r["wall_s"] for r in result.history)
    out["workers_used"] = len(result.workers)
    return out


# ---- the comparison ---------------------------------------------------------------------------
def run_subprocess(runner: str, workload: str) -> dict:
    env = {**os.environ, T0_ENV: repr(time.time())}
    proc = subprocess.run(
        [sys.executable, __file__, "--runner", runner, "--workload", workload],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{runner}/{workload} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_mixtrain() -> None:
    """mixtrain's modules compiled once, as `pip install` leaves an installed package: an editable install where
    PYTHONDONTWRITEBYTECODE is set (this project's CI machine) compiles every module again in every process, 0.1-0.15
    s of each start (the driver's and every worker's; torch, installed by pip, is compiled). First step on the MLP
    (`mixtrain-all`, 4 pairs alternating, 2026-12-06): 5.28-5.93 s from source, 5.11-5.41 s compiled."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("mixtrain")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        compileall.compile_dir(folder, quiet=1)


BESIDE_RAY = """
import sys
from mixtrain.cluster import connect
connect.start_embedded(num_cpus=1, log_to_driver=False, logging_level="ERROR")
print("up", flush=True)
sys.stdin.read()  # until the comparison closes it
connect.stop_ray_uninterrupted()
"""


@contextlib.contextmanager
def beside_ray(on: bool) -> Iterator[None]:
    """A second embedded Ray, started as mixtrain starts its own, idling on this machine for the block."""
    if not on:
        yield
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", BESIDE_RAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != "up":
            raise RuntimeError("the second Ray (--beside-ray) did not start")
        yield
    finally:
        proc.stdin.close()  # it stops its Ray and exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def compare(workloads: list[str], runners: list[str], repeats: int) -> dict:
    compile_mixtrain()
    results: dict = {}
    for rep in range(repeats):
        for workload in workloads:
            for runner in runners:
                out = run_subprocess(runner, workload)
                results.setdefault(workload, {}).setdefault(runner, []).append(out)
                print(
                    f"  [{rep + 1}/{repeats}] {workload:4s} {runner:9s} {out['samples_per_s']:9,.0f} samples/s  "
                    f"first step {out['first_step_s']:5.1f} s"
                    + (f"  loop CPU {out['cpu_s']:5.1f} s" if "cpu_s" in out else ""),
                    file=sys.stderr,
                    flush=True,
                )
    return results


def table(results: dict) -> str:
    lines = [
        "| workload | runner | workers | samples/s (median) | vs DDP | first step (s) | mixtrain first step vs it |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for workload, by_runner in results.items():
        med = {r: statistics.median(o["samples_per_s"] for o in outs) for r, outs in by_runner.items()}
        first = {r: statistics.median(o["first_step_s"] for o in outs) for r, outs in by_runner.items()}
        for runner in by_runner:
            vs_ddp = f"{med[runner] / med['ddp']:.2f}x" if "ddp" in med else "-"
            vs_first = f"{first['mixtrain'] / first[runner]:.2f}x" if "mixtrain" in first else "-"
            used = by_runner[runner][-1].get("workers_used", 1 if runner.startswith("single") else NUM_WORKERS)
            lines.append(
                f"| {workload} | {runner} | {used} | {med[runner]:,.0f} | {vs_ddp} | {first[runner]:.1f} | {vs_first} |"
            )
    return "\n".join(lines)


def step_overhead(results: dict) -> str:
    """mixtrain's own cost per step: one worker (no exchange) against one plain process, 1 thread each."""
    lines = []
    for workload, by_runner in results.items():
        if "single1" in by_runner and "mixtrain1" in by_runner:
            step_s = {r: GLOBAL_BATCH / statistics.median(o["samples_per_s"] for o in by_runner[r]) for r in by_runner}
            plain, mixtrain = step_s["single1"], step_s["mixtrain1"]
            lines.append(
                f"{workload}: one plain process {plain * 1e3:.2f} ms per step, one mixtrain worker "
                f"{mixtrain * 1e3:.2f} ms: {(mixtrain - plain) * 1e6:+,.0f} us per step"
            )
    return "\n".join(lines)


def emulation_table(results: dict, emulate: str) -> str:
    """Against the ideal (normal worker alone + slow worker alone) and equal-split DDP."""
    from mixtrain.config import parse_slowdown

    factor = max(f for f, _ in parse_slowdown(emulate).values())
    lines = [
        f"EMULATION {emulate}: ideal = single1 x (1 + 1/{factor:g})",
        "| workload | runner | samples/s | vs ideal | vs equal-split DDP | workers used | final shares |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for workload, by_runner in results.items():
        med = {r: statistics.median(o["samples_per_s"] for o in outs) for r, outs in by_runner.items()}
        ideal = med.get("single1", 0.0) * (1 + 1 / factor)
        for runner, outs in by_runner.items():
            vs_ideal = f"{med[runner] / ideal:.2f}" if ideal else "-"
            vs_ddp = f"{med[runner] / med['ddp']:.2f}x" if "ddp" in med else "-"
            shares = outs[-1].get("final_shares", "")
            used = outs[-1].get("workers_used", 1 if runner.startswith("single") else NUM_WORKERS)
            lines.append(f"| {workload} | {runner} | {med[runner]:,.0f} | {vs_ideal} | {vs_ddp} | {used} | {shares} |")
    return "\n".join(lines)


def shares_per_round(results: dict) -> str:
    """mixtrain's shares round by round (last repeat): how fast a slowdown is rebalanced."""
    lines = []
    for workload, by_runner in results.items():
        for runner, outs in by_runner.items():
            if "shares_per_round" in outs[-1]:
                rounds = outs[-1]["shares_per_round"]
                lines.append(f"{workload} {runner} shares per round: " + " ".join(f"{r}" for r in rounds))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runner",
        help=f"one of {', '.join(RUNNERS)}, ddp-sliced, single1, mixtrain1, mixtrain-default, mixtrain-equal, "
        "mixtrain-all, mx:NAME[+bf16]",
    )
    parser.add_argument("--workload", choices=list(WORKLOADS))
    parser.add_argument("--out", help="(ddp-rank, mxrun-rank) where rank 0 writes its result")
    parser.add_argument("--workloads", default="mlp,cnn")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench_results/compare.json", help="where the raw results go")
    parser.add_argument("--beside-ray", action="store_true", help="a second Ray idles on the machine throughout")
    parser.add_argument("--emulate", help="EMULATION: RANK:FACTOR, e.g. 1:3 (sets MIXTRAIN_EMULATE_SLOWDOWN)")
    args = parser.parse_args()
    if args.emulate:
        os.environ[EMULATE_ENV] = args.emulate
    if args.runner == "ddp-rank":
        out = run_ddp_rank(args.workload)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(out))
        return
    if args.runner == "mxrun-rank":  # a worker of `mixtrain run compare.py` (run_mxrun)
        _mxloop({"workload": args.workload, "out": args.out})
        return
    if args.runner and args.runner.startswith("mx:"):
        print(json.dumps(run_mixtrain(args.workload, keep_all=True, strategy=args.runner[3:])))
        return
    if args.runner:
        runner = {
            "single": run_single,
            "ddp": run_ddp,
            "ddp-sliced": lambda w: run_ddp(w, presliced=True),
            "raytrain": run_raytrain,
            "mixtrain": run_mixtrain,
            "single1": lambda w: run_single(w, threads=1),
            "mixtrain-equal": lambda w: run_mixtrain(w, shares="equal"),
            "mixtrain-all": lambda w: run_mixtrain(w, keep_all=True),
            "mixtrain1": lambda w: run_mixtrain(w, workers=1),
            "mixtrain-default": lambda w: run_mixtrain(w, workers=None),
            "mxloop": run_mxloop,
            "mxloop-equal": lambda w: run_mxloop(w, shares="equal"),
            "mxloop1": lambda w: run_mxloop(w, workers=1),
            "mxloop-default": lambda w: run_mxloop(w, workers=None),
            "mxrun": run_mxrun,
        }
        print(json.dumps(runner[args.runner](args.workload)))
        return
    with beside_ray(args.beside_ray):
        results = compare(args.workloads.split(","), args.runners.split(","), args.repeats)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    print(step_overhead(results))
    if args.emulate:
        print(emulation_table(results, args.emulate))
        print(shares_per_round(results))


if __name__ == "__main__":
    main()
