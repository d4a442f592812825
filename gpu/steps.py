"""The check's steps that need the Python API; `gpu/check.py` runs each as its own process:

    python -m gpu.steps env|exactness|sliced|caps|loop|overhead|nccl|lost-worker [--devices cpu|cuda] --out RESULT.json

Only mixtrain's public API (`from mixtrain import ...`), its built-in examples and the tests' task
factories (tests/models.py) are used, so this keeps working while mixtrain's modules move. Each step
writes {"result", "figure", "detail": [...], "data": {...}} to --out; "result" is "pass", "fail", "below
goal" (overhead) or "refused" (NCCL, when mixtrain stops with an error), never a guess.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

if TYPE_CHECKING:
    from mixtrain.config import Backend, DeviceKind

EXACT_SAMPLES = 640
"""The exactness runs use the whole data set as the global batch: every step is the same B samples in every
process, so single-process PyTorch needs no knowledge of mixtrain's sample order."""
EXACT_STEPS = 30
EXACT_TOL = {"cpu": 1e-5, "cuda": 1e-4}
"""Relative L2 difference allowed per tensor: CPUs only (docs/how-it-works.md promises it), and with a CUDA rank
(its fp32 kernels sum in another order than the CPU's; tests/gpu allows the same)."""
OVERHEAD_GOAL = 0.95
OVERHEAD_EPOCHS = 20


def _nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # no NCCL in this build of torch
        return f"none ({type(e).__name__})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def env() -> dict[str, Any]:
    import ray

    import mixtrain

    data: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "ray": ray.__version__,
        "ray_path": str(Path(ray.__file__).parent),
        "mixtrain": mixtrain.__version__,
        "mixtrain_path": str(Path(mixtrain.__file__).parent),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    if data["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        data.update(
            gpu=torch.cuda.get_device_name(0),
            gpus=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            nccl=_nccl_version(),
            bf16=torch.cuda.is_bf16_supported(),
        )
        device = f"{data['gpu']} ({data['gpu_memory_gib']} GiB, CUDA {data['torch_cuda']})"
    else:
        device = f"no CUDA device (CPU only, {data['cpus']} cores)"
    return {
        "result": "pass",
        "figure": f"{device}; torch {data['torch']}, Ray {data['ray']}, mixtrain {data['mixtrain']}",
        "detail": [f"{k}: {v}" for k, v in data.items()],
        "data": data,
    }


def _exact_run(
    groups: list,
    shares: list[int] | Literal["auto", "equal"],
    opt: str,
    run_dir: Path,
    backend: Backend = "auto",
    shard: Any = "none",
    model: str = "mlp",
    steps: int = EXACT_STEPS,
) -> tuple[dict, list[dict]]:
    from mixtrain import RunConfig, ScalingConfig, Trainer
    from tests.models import data, factory

    samples = EXACT_SAMPLES if shares in ("auto", "equal") else sum(shares)  # type: ignore[arg-type]
    x, y = data(model, samples)
    trainer = Trainer(
        factory(model, opt),
        (x, y),
        global_batch=samples,
        scaling=ScalingConfig(
            groups=groups,
            shares=shares,
            backend=backend,
            shard=shard,
            shard_slices=None if shard == "none" else [3, 1, 2][: sum(g.num_workers for g in groups)],
        ),
        run=RunConfig(run_dir=str(run_dir), seed=7, progress=False, tensorboard=False),
    )
    result = trainer.fit(epochs=steps)
    return result.state_dict, result.workers


def _reference(
    opt: str, model: str = "mlp", steps: int = EXACT_STEPS, samples: int = EXACT_SAMPLES
) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch on the CPU: `steps` steps of the whole data set."""
    from tests.models import data, make_task

    x, y = data(model, samples)
    torch.manual_seed(7)
    task = make_task(model, opt)
    for _ in range(steps):
        task.optimizer.zero_grad()
        task.batch_loss(task.model, (x, y)).backward()
        task.optimizer.step()
    return task.model.state_dict()


def _run_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of a run folder's metrics.jsonl (docs/run-folder.md), in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(
        float((got[k].double() - want[k].double()).norm() / want[k].double().norm().clamp_min(1e-12)) for k in want
    )


def exactness(devices: str, work: Path) -> dict[str, Any]:
    from mixtrain import DeviceGroup

    if devices == "cuda":
        groups = [DeviceGroup(device="cuda", num_workers=1), DeviceGroup(device="cpu", num_workers=2)]
        shares = [300, 200, 140]
    else:
        groups = [DeviceGroup(device="cpu", num_workers=2)]
        shares = [400, 240]
    tol = EXACT_TOL[devices]
    detail, worst = [], 0.0
    for opt in ("sgd", "adamw"):
        got, workers = _exact_run(groups, shares, opt, work / f"exact-{devices}-{opt}")
        err = _max_rel_diff(got, _reference(opt))
        worst = max(worst, err)
        where = ", ".join(f"{w.get('device')}:{s}" for w, s in zip(sorted(workers, key=lambda w: w["rank"]), shares))
        detail.append(f"mlp + {opt}: shares {where}, {EXACT_STEPS} steps: max relative difference {err:.2e}")
    detail.append(f"global batch = the whole data set ({EXACT_SAMPLES} samples); fp32; tolerance {tol:g} per tensor")
    return _difference_verdict(worst, tol, detail)


def _difference_verdict(worst: float, tol: float, detail: list[str]) -> dict[str, Any]:
    """An exactness step's result: pass when the largest relative difference from one process is within `tol`."""
    return {
        "result": "pass" if worst <= tol else "fail",
        "figure": f"max relative difference {worst:.1e} (tolerance {tol:g})",
        "detail": detail,
        "data": {"max_rel_diff": worst, "tolerance": tol},
    }


def sliced_exactness(devices: str, work: Path) -> dict[str, Any]:
    """shard="full" and "gradients" (weights and gradients sliced 3:1:2 by memory) over unequal shares equal one
    process on the CPU, for SGD with momentum and AdamW."""
    from mixtrain import DeviceGroup

    shares = [300, 200, 140]
    groups = [DeviceGroup(device="cpu", num_workers=3)]
    if devices == "cuda":
        groups = [DeviceGroup(device="cuda", num_workers=1), DeviceGroup(device="cpu", num_workers=2)]
    tol = EXACT_TOL[devices]
    detail, worst = [], 0.0
    for shard, opt in (("full", "adamw"), ("gradients", "sgd")):
        got, workers = _exact_run(groups, shares, opt, work / f"sliced-{devices}-{shard}", shard=shard)
        err = _max_rel_diff(got, _reference(opt))
        worst = max(worst, err)
        held = [w.get("device") for w in sorted(workers, key=lambda w: w["rank"])]
        detail.append(f"shard={shard} + mlp + {opt} on {held}, slices 3:1:2: max relative difference {err:.2e}")
    return _difference_verdict(worst, tol, detail)


CAP_MB = {"cuda": 96, "cpu": 150}
"""caps: the capped worker's DeviceGroup(memory=...): on CUDA below the activations of its share of the "wide"
model (2,400 samples x 4,096 hidden units, about 200 MB with their gradients), so its micro-batch must shrink; on
the CPU below any process's resident set, so each worker is named over it."""
CAP_STEPS = 5


def caps(devices: str, work: Path) -> dict[str, Any]:
    """DeviceGroup(memory=...) kept to. CUDA: the capped worker's tensors stay under the cap (its round peaks,
    torch's max_memory_allocated) while it trains its share in smaller micro-batches, and the weights equal one
    process's. CPU (nothing holds a process to a figure): each worker over its cap is named once, weights exact."""
    from mixtrain import DeviceGroup

    cap = CAP_MB[devices] * 2**20
    if devices == "cuda":
        groups = [DeviceGroup(device="cuda", num_workers=1, memory=cap), DeviceGroup(device="cpu", num_workers=2)]
        shares = [2400, 80, 80]
    else:
        groups, shares = [DeviceGroup(device="cpu", num_workers=2, memory=cap)], [400, 240]
    run_dir = work / f"caps-{devices}"
    got, _ = _exact_run(groups, shares, "adamw", run_dir, model="wide", steps=CAP_STEPS)
    err = _max_rel_diff(got, _reference("adamw", "wide", CAP_STEPS, sum(shares)))
    records = _run_records(run_dir)
    rounds = [r for r in records if r.get("kind") == "round"]
    over = [r for r in records if r.get("kind") == "memory_over_cap"]
    capped = [w for r in rounds for w in r["workers"] if w.get("device", "").startswith(devices)]
    peak = max((w["memory_bytes"] or 0 for w in capped), default=0)
    plans = [r for r in records if r.get("kind") == "plan"]
    micro = plans[-1].get("micro_batches") if plans else None
    detail = [
        f"wide model + adamw, shares {shares}, {CAP_STEPS} steps, {devices} worker(s) capped at {CAP_MB[devices]} MB",
        f"max relative difference from one process {err:.2e} (tolerance {EXACT_TOL[devices]:g})",
        f"capped worker's round peak {peak / 2**20:.1f} MB; micro-batches {micro}; memory_over_cap records {len(over)}",
    ]
    if devices == "cuda":
        ok = 0 < peak <= cap and not over
        figure = f"CUDA peak {peak / 2**20:.1f} MB under a {CAP_MB[devices]} MB cap, difference {err:.1e}"
    else:
        ok = sorted(r["bundle"] for r in over) == [0, 1]
        figure = f"{len(over)} of 2 CPU workers named over a {CAP_MB[devices]} MB cap, difference {err:.1e}"
    verdict = _difference_verdict(err, EXACT_TOL[devices], detail)
    return {**verdict, "result": "pass" if ok and verdict["result"] == "pass" else "fail", "figure": figure}


def loop_exactness(devices: str, work: Path) -> dict[str, Any]:
    """A user's own loop (mixtrain.train: AdamW, a cosine schedule, clip_grad_norm_) over unequal shares equals one
    process on the CPU training the whole global batch."""
    from mixtrain import DeviceGroup, ScalingConfig
    from mixtrain.train import RunConfig
    from mixtrain.train.torch import TorchTrainer
    from tests import loops

    if devices == "cuda":
        groups = [DeviceGroup(device="cuda", num_workers=1), DeviceGroup(device="cpu", num_workers=2)]
        shares = [14, 9, 7]
    else:
        groups, shares = [DeviceGroup(device="cpu", num_workers=2)], [12, 8]
    work.mkdir(parents=True, exist_ok=True)
    config = {"data": loops.data(150), "batch": 10, "epochs": 2, "opt": "adamw", "clip": True, "out": str(work)}
    TorchTrainer(
        loops.classifier_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(groups=groups, shares=shares),
        run_config=RunConfig(storage_path=str(work / "runs"), seed=loops.SEED, progress=False),
    ).fit()
    got = {k: v.cpu() for k, v in torch.load(work / "weights.pt", map_location="cpu").items()}
    err = _max_rel_diff(got, loops.reference(config, workers=len(shares)))
    detail = [f"loop over {devices} with shares {shares}: AdamW, cosine schedule, clip_grad_norm_, 2 epochs"]
    return _difference_verdict(err, EXACT_TOL[devices], detail)


def _update(mode: str, task: Any, loss: torch.Tensor, gate: Any) -> None:
    """The plain loop's optimizer step, in `mode` (see _plain_loop)."""
    grads = [p.grad for p in task.model.parameters() if p.grad is not None]
    if gate is not None:
        gate.step(task, grads, loss.detach().reshape(1), lambda: None)
        gate.drain()
    elif mode != "read" or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)).all()):
        task.optimizer.step()


class _StepsProfile:
    """With MIXTRAIN_PROFILE_DIR set: the first `count` steps after start() under torch.profiler, to <name>.txt."""

    def __init__(self, dev: torch.device, name: str, count: int) -> None:
        self.dir, self.dev, self.name, self.count = os.environ.get("MIXTRAIN_PROFILE_DIR"), dev, name, count
        self.prof: Any = None
        self.seen = 0

    def start(self) -> None:
        if self.dir:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.dev.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()

    def step_done(self, sync: Any) -> None:
        if self.prof is None:
            return
        self.seen += 1
        if self.seen == self.count:
            sync()
            self.prof.__exit__(None, None, None)
            table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            Path(str(self.dir)).mkdir(parents=True, exist_ok=True)
            Path(str(self.dir), f"{self.name}.txt").write_text(
                f"# plain loop ({self.name}), {self.count} steps\n{table}\n"
            )
            self.prof = None


def _plain_loop(
    job: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    dev: torch.device,
    sync: Any,
    epochs: int,
    mode: str = "plain",
) -> float:
    """Samples/s of a plain PyTorch loop over (x, y) after one untimed epoch. `mode`: "plain"; "read" (one host
    read of the all-finite verdict per step, as mixtrain did before StepGate); "gate" (mixtrain's StepGate: the
    verdict on the device, the fused optimizer skipping, read a step late); "fused" (the fused optimizer alone).
    With MIXTRAIN_PROFILE_DIR set, the second epoch's first 20 steps run under torch.profiler (<mode>.txt)."""
    from mixtrain.comm.step_gate import StepGate, _use_fused

    torch.manual_seed(0)
    task = job.task_factory()
    task.model.to(dev)
    gate = StepGate(task.optimizer, dev) if mode == "gate" else None
    if mode == "fused":
        _use_fused(task.optimizer)
    gen = torch.Generator().manual_seed(0)
    steps = (len(y) + batch - 1) // batch
    profile = _StepsProfile(dev, mode, min(steps, 20))
    t_start = 0.0
    for epoch in range(epochs):
        if epoch == 1:
            sync()
            t_start = time.perf_counter()
            profile.start()
        perm = torch.randperm(len(y), generator=gen)
        for s in range(steps):
            idx = perm[s * batch : (s + 1) * batch]
            xb, yb = x[idx].to(dev), y[idx].to(dev)
            task.optimizer.zero_grad(set_to_none=True)
            loss = task.batch_loss(task.model, (xb, yb))
            loss.backward()
            _update(mode, task, loss, gate)
            profile.step_done(sync)
    sync()
    return (epochs - 1) * len(y) / (time.perf_counter() - t_start)


def overhead(work: Path, devices: DeviceKind = "cuda", epochs: int = OVERHEAD_EPOCHS) -> dict[str, Any]:
    """One CUDA worker under mixtrain against a plain PyTorch loop: the chars example's model, data and
    global batch; both untimed for their first epoch (warm-up), then samples/s over the rest."""
    from mixtrain import DeviceGroup, RunConfig, ScalingConfig, Trainer

    job = importlib.import_module("mixtrain.examples.chars").example()
    windows = job.train_data()  # the example builds its TokenWindows on each worker; here, once, as tensors
    x, y = torch.utils.data.default_collate([windows[i] for i in range(len(windows))])
    batch = job.global_batch
    dev = torch.device("cuda", 0) if devices == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if devices == "cuda" else (lambda: None)

    if devices == "cpu":  # a smoke run of this step without a GPU: the worker computes on 1 thread, so here too
        torch.set_num_threads(1)
    # plain PyTorch: the batch indexed on the CPU and copied to the card each step (as from a DataLoader)
    steps = (len(y) + batch - 1) // batch
    plain = _plain_loop(job, x, y, batch, dev, sync, epochs)
    # the same, reading one "all finite?" verdict per step as mixtrain did before it applied a step; with
    # mixtrain's StepGate instead; with the fused optimizer alone (what the gate switches to)
    variants = {m: _plain_loop(job, x, y, batch, dev, sync, max(2, epochs // 2), m) for m in ("read", "gate", "fused")}
    plain_read = variants["read"]
    if devices == "cuda":
        torch.cuda.empty_cache()

    trainer = Trainer(
        job.task_factory,
        (x, y),  # the same tensors as the plain loop: the zero-copy path, framework overhead alone
        global_batch=batch,
        scaling=ScalingConfig(groups=[DeviceGroup(device=devices, num_workers=1)]),
        run=RunConfig(run_dir=str(work / "overhead"), seed=0, progress=False, tensorboard=False),
    )
    t0 = time.perf_counter()
    result = trainer.fit(epochs=epochs)
    fit_s = time.perf_counter() - t0
    # the run folder's round records carry the time each round ended (Result.history has no clock)
    rounds = [r for r in _run_records(Path(result.run_dir)) if r.get("kind") == "round"]
    first_epoch = [r for r in rounds if r["epoch"] == 0]
    later = [r for r in rounds if r["epoch"] > 0]
    samples = sum(r["samples"] for r in later)
    # from the end of the first epoch's last round to the end of the last round: every cost between rounds
    # (the driver's calls, checkpoints at epoch ends) counts
    span = rounds[-1]["time"] - first_epoch[-1]["time"]
    mx = samples / span
    inside = sum(r["wall_s"] for r in later)
    mx_rounds = samples / inside
    ratio = mx / plain
    logs = "".join(f.read_text(errors="replace") for f in Path(result.run_dir).glob("logs/worker-*.log"))
    gated = "StepGate" in logs
    return {
        "result": "pass" if ratio >= OVERHEAD_GOAL else "below goal",
        "figure": f"mixtrain {mx:,.0f} vs plain PyTorch {plain:,.0f} samples/s = {ratio:.2f}x (goal {OVERHEAD_GOAL}x)",
        "detail": [
            f"chars transformer, global batch {batch}, {epochs} epochs of {steps} steps; first epoch untimed",
            f"plain loop: batch indexed on the CPU, copied to the card each step, no per-step host sync: "
            f"{plain:,.0f} samples/s; with one host read per step (the all-finite verdict) {plain_read:,.0f}; "
            f"with StepGate {variants['gate']:,.0f}; with the fused optimizer alone {variants['fused']:,.0f}",
            f"mixtrain, 1 {devices} worker: {mx:,.0f} samples/s from round ends (driver calls and epoch-end "
            f"checkpoints included), {mx_rounds:,.0f} samples/s inside its rounds; fit() took {fit_s:.1f} s "
            f"({result.seconds_to_first_step:.1f} s to the first step)",
            f"the worker's all-finite verdict: {'read a step late (StepGate)' if gated else 'read every step'}",
            f"{len(later)} timed rounds; between them {1e3 * (span - inside) / max(1, len(later)):.1f} ms a round "
            f"({100 * (span - inside) / span:.0f}% of the timed span)",
        ],
        "data": {
            "plain": plain,
            "plain_read_each_step": plain_read,
            "plain_gate": variants["gate"],
            "plain_fused": variants["fused"],
            "gated": gated,
            "mixtrain": mx,
            "mixtrain_rounds": mx_rounds,
            "ratio": ratio,
            "rounds": len(later),
            "between_rounds_s": span - inside,
        },
    }


def _backend_of(run_dir: Path) -> str:
    """The collective backend a run used, from its run folder's config.json."""
    return str(json.loads((run_dir / "config.json").read_text()).get("backend"))


def nccl(work: Path) -> dict[str, Any]:
    """NCCL on the CUDA workers that fit: one worker under --backend nccl; two CUDA workers under the default
    backend (auto); and two under --backend nccl, which on one card must be refused by mixtrain with the fix
    (NCCL itself takes one rank per GPU: "Duplicate GPU detected"), on two cards must train. Every run that
    trains is checked against single-process weights."""
    from mixtrain import DeviceGroup

    one_card = torch.cuda.device_count() < 2
    pair = [DeviceGroup(device="cuda", num_workers=2, resources_per_worker={"GPU": 0.5 if one_card else 1.0})]
    where = "on one card (GPU 0.5 each)" if one_card else "on two cards"
    runs = [
        ("1 CUDA worker, nccl", [DeviceGroup(device="cuda", num_workers=1)], [EXACT_SAMPLES], "nccl", "nccl"),
        (f"2 CUDA workers {where}, auto", pair, [400, 240], "auto", "gloo" if one_card else "nccl"),
        (f"2 CUDA workers {where}, nccl", pair, [400, 240], "nccl", None if one_card else "nccl"),
    ]
    detail, outcomes = [], []
    for i, (what, groups, shares, backend, expected) in enumerate(runs):
        run_dir = work / f"nccl-{i}"
        try:
            got, _ = _exact_run(groups, shares, "sgd", run_dir, backend=cast("Backend", backend))
        except Exception as e:
            message = " ".join(f"{type(e).__name__}: {e}".split())[:600]
            told = expected is None and "share one GPU" in message  # refused before any group formed, with the fix
            detail.append(f"{what}: refused{' as it must be' if told else ''}: {message}")
            outcomes.append("pass" if told else "refused")
            continue
        err = _max_rel_diff(got, _reference("sgd"))
        used = _backend_of(run_dir)
        ok = err <= EXACT_TOL["cuda"] and used == expected
        detail.append(
            f"{what}: trained over {used} (expected {expected}); max relative difference to one process {err:.1e}"
        )
        outcomes.append("pass" if ok else "fail")
    result = "fail" if "fail" in outcomes else ("refused" if "refused" in outcomes else "pass")
    return {"result": result, "figure": "; ".join(f"{r[0]}: {o}" for r, o in zip(runs, outcomes)), "detail": detail}


LOST_AT_CALL = 7
"""The lost worker stops (SIGSTOP, a laptop asleep) in its 7th training step: the others wait in a collective."""
LOST_TIMEOUT_S = "10"
"""MIXTRAIN_COLLECTIVE_TIMEOUT_S for the lost-worker runs: how long the survivors wait before they give up."""


def _lost_run(what: str, groups: list, shares: list[int], lost_rank: int, backend: Backend, run_dir: Path) -> str:
    """One run with worker `lost_rank` stopped mid-round: (pass|fail|refused, one line of detail)."""
    import functools

    from mixtrain import RunConfig, ScalingConfig, Trainer
    from tests.models import data, faulty_task

    x, y = data("mlp", EXACT_SAMPLES)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = functools.partial(faulty_task, "mlp", "sgd", "stop", lost_rank, LOST_AT_CALL, str(run_dir / "fired"))
    trainer = Trainer(
        task,
        (x, y),
        global_batch=EXACT_SAMPLES,
        scaling=ScalingConfig(groups=groups, shares=shares, backend=backend, leave_out_slow=False),
        run=RunConfig(
            run_dir=str(run_dir / "run"), seed=7, progress=False, tensorboard=False, rejoin=False, steps_per_round=2
        ),
    )
    try:
        result = trainer.fit(epochs=EXACT_STEPS)
    except Exception as e:
        return f"refused|{what}: {' '.join(f'{type(e).__name__}: {e}'.split())[:500]}"
    records = _run_records(Path(result.run_dir))
    started = next(r["workers"] for r in records if r.get("kind") == "workers")
    failures = [r for r in records if r.get("kind") == "failure"]
    lost = sorted(w["worker"]["rank"] for f in failures for w in f["lost"])
    # the survivors are the same processes: none was ended by the NCCL watchdog (the last round names its
    # workers "cuda:0 on host (pid N)")
    survivors = {w["pid"] for w in started if w["rank"] != lost_rank}
    last = [r for r in records if r.get("kind") == "round"][-1]
    same = survivors == {int(re.search(r"pid (\d+)", w["worker"]).group(1)) for w in last["workers"]}  # type: ignore[union-attr]
    err = _max_rel_diff(result.state_dict, _reference("sgd"))
    ok = lost == [lost_rank] and same and err <= EXACT_TOL["cuda"] and (run_dir / "fired").exists()
    return (
        f"{'pass' if ok else 'fail'}|{what}: lost {lost} (stopped: {lost_rank}); survivors kept their processes: "
        f"{same}; max relative difference to one process {err:.1e}"
    )


def lost_worker(work: Path, devices: str = "cuda") -> dict[str, Any]:
    """A worker lost mid-round (SIGSTOP) on the GPU paths: the survivors' collective must fail with a Python
    exception within MIXTRAIN_COLLECTIVE_TIMEOUT_S (under NCCL: not the watchdog ending the process), and the
    run re-forms without it and ends with single-process weights. `devices="cpu"`: the same on 3 CPU workers
    (gloo), to check the step itself where there is no GPU."""
    from mixtrain import DeviceGroup

    os.environ["MIXTRAIN_COLLECTIVE_TIMEOUT_S"] = LOST_TIMEOUT_S
    if devices == "cpu":
        runs = [
            (
                "gloo, 3 CPU workers, worker 2 stopped",
                [DeviceGroup(device="cpu", num_workers=3)],
                [300, 200, 140],
                2,
                "gloo",
            )
        ]
    elif not torch.cuda.is_available():
        return {"result": "skipped", "figure": "no CUDA device: skipped", "detail": []}
    else:
        runs = _gpu_lost_runs()
    outcomes, detail = [], []
    for i, (what, groups, shares, lost, backend) in enumerate(runs):
        outcome, line = _lost_run(what, groups, shares, lost, cast("Backend", backend), work / f"lost-{i}").split(
            "|", 1
        )
        outcomes.append(outcome)
        detail.append(f"{line} ({outcome})")
    if devices == "cuda" and torch.cuda.device_count() < 2:
        detail.append("nccl: not run: one GPU here, and NCCL takes one worker per GPU (needs 2 GPUs)")
    detail.append(f"MIXTRAIN_COLLECTIVE_TIMEOUT_S={LOST_TIMEOUT_S}; stopped in its {LOST_AT_CALL}th step; rejoin off")
    result = "fail" if "fail" in outcomes else ("refused" if "refused" in outcomes else "pass")
    figure = "; ".join(f"{r[4]}: {o}" for r, o in zip(runs, outcomes))
    return {"result": result, "figure": figure, "detail": detail}


def _gpu_lost_runs() -> list[tuple[str, list, list[int], int, str]]:
    """gloo over a CUDA and two CPU workers; NCCL over two CUDA workers where there are two cards (NCCL takes one
    rank per GPU, and mixtrain refuses two on one card: the nccl step checks that refusal)."""
    from mixtrain import DeviceGroup

    runs = [
        (
            "gloo, CUDA + 2 CPU workers, CPU worker 2 stopped",
            [DeviceGroup(device="cuda", num_workers=1), DeviceGroup(device="cpu", num_workers=2)],
            [300, 200, 140],
            2,
            "gloo",
        ),
    ]
    if torch.cuda.device_count() > 1:
        runs.append(
            (
                "nccl, 2 CUDA workers (a GPU each), worker 1 stopped",
                [DeviceGroup(device="cuda", num_workers=2, resources_per_worker={"GPU": 1.0})],
                [400, 240],
                1,
                "nccl",
            )
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu.steps")
    ap.add_argument("step", choices=["env", "exactness", "sliced", "caps", "loop", "overhead", "nccl", "lost-worker"])
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--epochs", type=int, default=OVERHEAD_EPOCHS, help="overhead: epochs (the first untimed)")
    ap.add_argument("--work", type=Path, default=Path("mixtrain_runs", "gpu-steps"), help="the steps' run folders")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.step == "env":
            out = env()
        elif args.step == "exactness":
            out = exactness(args.devices, args.work)
        elif args.step == "sliced":
            out = sliced_exactness(args.devices, args.work)
        elif args.step == "caps":
            out = caps(args.devices, args.work)
        elif args.step == "loop":
            out = loop_exactness(args.devices, args.work / f"loop-{args.devices}")
        elif args.step == "overhead":
            out = overhead(args.work, args.devices, args.epochs)
        elif args.step == "lost-worker":
            out = lost_worker(args.work, args.devices)
        else:
            out = nccl(args.work)
    except Exception as e:
        traceback.print_exc()
        out = {"result": "fail", "figure": " ".join(f"{type(e).__name__}: {e}".split())[:300], "detail": []}
    args.out.write_text(json.dumps(out, default=str))
    return 0 if out["result"] in ("pass", "refused", "below goal", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
