"""Sliced state (ScalingConfig.shard) against torch FSDP2 on a GPT-2-like decoder, and the what-if plan against
each worker's measured peak RSS (issue 48).

Command lines:
    python benchmarks/sliced.py            # all three parts, about 6 minutes on 2 busy cores
    python benchmarks/sliced.py --quick    # fewer steps, about 4 minutes
    python benchmarks/sliced.py --parts speed      # FSDP2 vs shard="full" vs shard="none" only
    python benchmarks/sliced.py --parts fit        # the 3-worker "fits no single capped worker" run only
    python benchmarks/sliced.py --parts fit --size issue --quick   # the same at the issue's 150M and 2.0/1.25/1.5 GB

1. speed: one GPT-2 (transformers.GPT2LMHeadModel from a config, nothing downloaded), the same batches and AdamW,
   on 2 equal CPU worker processes x 1 thread over gloo: torch FSDP2 (`fully_shard` on each GPT2Block, then on the
   model; launched with torch.multiprocessing spawn) against mixtrain shard="full" and shard="none" (shares
   "equal"). samples/s counts the steps after the warm-up (mixtrain: the rounds that start after it, from
   Result.history, as benchmarks/compare.py does); start-up is excluded from both.
2. fit: a larger decoder whose what-if plan (mixtrain.policies.memory_plan, the `mixtrain plan` arithmetic) says
   neither "none" nor "optimizer" fits caps in the proportion 2.0 : 1.25 : 1.5, but "full" fits on all three; it
   trains a few steps on 3 CPU workers with shard="full" and shard_slices in the caps' proportion, and each
   worker's peak RSS is printed beside the plan's prediction for that worker. Mixtrain does not enforce a cap:
   the caps are only what the plan is asked about. `--size issue` runs the issue's own example instead: a
   148.1M-parameter decoder (20 layers x 768, vocabulary 8,192) on caps of exactly 2.0 / 1.25 / 1.5 GB.

Peak memory is each process's own VmHWM (/proc/self/status) read in that process: FSDP2's ranks at the end,
mixtrain's workers inside Task.compute_loss at every forward (so it includes Ray's own worker memory and the
start-up probe's passes on the whole model, and excludes the last step's backward, which repeats the earlier
steps'). Each runner is its own subprocess; the machine is shared, so the numbers move between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MIB = 2**20
LR = 1e-3
SPEED_MODEL = {"vocab": 8192, "n_embd": 384, "n_layer": 4, "n_head": 6, "seq": 128}
FIT_MODEL = {"vocab": 8192, "n_embd": 512, "n_layer": 20, "n_head": 8, "seq": 64}
ISSUE_MODEL = {"vocab": 8192, "n_embd": 768, "n_layer": 20, "n_head": 12, "seq": 64}
"""The issue's own example (--size issue): a 148.1M-parameter decoder, 2.2 GB of fp32 weights, gradients and AdamW
state, on caps of exactly CAP_RATIOS GB."""
FIT_MODELS = {"fit": FIT_MODEL, "issue": ISSUE_MODEL}
SPEED_BATCH = 16
FIT_BATCHES = {"fit": 6, "issue": 3}
"""The fit part's global batch, equal shares: micro-batch 2 per worker, 1 at the issue's size (the plan fits no
more on its 1.25 GB worker)."""
CAP_RATIOS = (2.0, 1.25, 1.5)
"""The issue's caps (GB) in proportion, scaled to FIT_MODEL: their sum halfway between the least at which "full"
fits every worker and the most at which "none" still fits no single worker."""


@dataclass(frozen=True)
class Steps:
    total: int
    warmup: int


STEPS = {False: Steps(total=12, warmup=4), True: Steps(total=7, warmup=3)}
FIT_STEPS = {False: 6, True: 4}


# ---- the model, data and loss, the same for every runner ------------------------------------------------
def make_model(cfg: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq"],
        n_embd=cfg["n_embd"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        bos_token_id=0,  # GPT-2's 50256 is outside the smaller vocabulary (transformers warns); unused here
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def make_data(cfg: dict, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, cfg["vocab"], (num_samples, cfg["seq"]), generator=torch.Generator().manual_seed(0))
    return ids, ids


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[1]).loss


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


@dataclass(frozen=True)
class RecordPeak:
    """compute_loss that also writes this worker's rank and peak RSS to `folder` (one file per process)."""

    folder: str

    def __call__(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        import torch.distributed as dist

        loss = lm_loss(model, batch)
        rank = dist.get_rank() if dist.is_initialized() else -1
        Path(self.folder, f"{os.getpid()}.json").write_text(json.dumps({"rank": rank, "peak": peak_rss()}))
        return loss


def read_peaks(folder: str) -> list[int]:
    records = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    return [r["peak"] for r in sorted(records, key=lambda r: r["rank"])]


# ---- torch FSDP2 -------------------------------------------------------------------------------------------
def fsdp_rank(rank: int, world: int, port: int, cfg: dict, steps: Steps, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model: Any = make_model(cfg)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data(cfg, SPEED_BATCH * steps.total)
    local = SPEED_BATCH // world
    t_measure = 0.0
    for step in range(steps.total):
        if step == steps.warmup:
            t_measure = time.perf_counter()
        start = step * SPEED_BATCH + rank * local
        lm_loss(model, (x[start : start + local], y[start : start + local])).backward()
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t_measure
    record = {"samples_per_s": (steps.total - steps.warmup) * SPEED_BATCH / elapsed, "peak": peak_rss()}
    Path(out, f"{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def run_fsdp(steps: Steps) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(fsdp_rank, args=(2, port, SPEED_MODEL, steps, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    return {"samples_per_s": min(r["samples_per_s"] for r in ranks), "peaks": [r["peak"] for r in ranks]}


# ---- mixtrain ----------------------------------------------------------------------------------------------
def _task(cfg: dict, peaks: str):
    from mixtrain import Task

    model = make_model(cfg)
    return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), compute_loss=RecordPeak(peaks))


def run_mixtrain(level: str, steps: Steps) -> dict:
    import functools

    from mixtrain import RunConfig, ScalingConfig, Trainer

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as peaks:
        result = Trainer(
            functools.partial(_task, SPEED_MODEL, peaks),
            make_data(SPEED_MODEL, SPEED_BATCH * steps.total),
            global_batch=SPEED_BATCH,
            scaling=ScalingConfig(num_workers=2, cpus_per_worker=1, shard=level, shares="equal"),  # type: ignore[arg-type]
            run=RunConfig(run_dir=tmp, progress=False, seed=0),
        ).fit(epochs=1)
        measured = [r for r in result.history if r["first_step"] >= steps.warmup]
        return {
            "samples_per_s": sum(r["samples"] for r in measured) / sum(r["wall_s"] for r in measured),
            "peaks": read_peaks(peaks),
            "steps_measured": sum(r["num_steps"] for r in measured),
        }


# ---- the 3-worker fit --------------------------------------------------------------------------------------
def fit_plan(size: str) -> dict:
    """The plan on caps in CAP_RATIOS' proportion, scaled so that "full" fits every worker and "none" none alone
    (--size issue: caps of CAP_RATIOS GB as they are)."""
    from mixtrain.policies.memory_plan import GIB, Device, holding, plan_memory
    from mixtrain.policies.model_shape import measure_shape

    cfg = FIT_MODELS[size]
    torch.manual_seed(0)
    model = make_model(cfg)
    x, y = make_data(cfg, 2)
    shape = measure_shape(model, torch.optim.AdamW(model.parameters(), lr=LR), lambda m, b: lm_loss(m, (x[:b], y[:b])))
    del model
    fractions = [c / sum(CAP_RATIOS) for c in CAP_RATIOS]
    micro = FIT_BATCHES[size] // len(CAP_RATIOS)
    full = [sum(holding(shape, "full", False, f, micro, "cpu").values()) for f in fractions]
    none = sum(holding(shape, "none", False, 1.0, micro, "cpu").values())
    least, most = max(h / f for h, f in zip(full, fractions, strict=True)), none / max(fractions)
    if least >= most:
        raise RuntimeError(f"{shape.describe()}: no caps fit 'full' but not 'none'; add blocks to FIT_MODEL")
    total = (least + most) / 2 if size == "fit" else sum(CAP_RATIOS) * GIB
    caps = [round(f * total / GIB, 2) for f in fractions]
    devices = [Device("cpu", int(c * GIB)) for c in caps]
    plan = plan_memory(shape, devices, 10e9 / 8, FIT_BATCHES[size])
    group = {o.level: o for o in plan.options if len(o.devices) > 1 and not o.offload}
    alone = [o for o in plan.options if len(o.devices) == 1 and not o.offload]
    return {
        "shape": shape.describe(),
        "caps_gb": caps,
        "fits": {level: o.fits for level, o in group.items()},
        "fits_alone": [o.fits for o in alone],
        "needs_gb": {level: [round(d.total / GIB, 3) for d in o.devices] for level, o in group.items()},
        "full_predicted": [h for h in full],
        "table": plan.table(),
    }


def run_fit(size: str, caps: list[float], num_steps: int) -> dict:
    import functools

    from mixtrain import RunConfig, ScalingConfig, Trainer

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as peaks:
        t0 = time.perf_counter()
        result = Trainer(
            functools.partial(_task, FIT_MODELS[size], peaks),
            make_data(FIT_MODELS[size], FIT_BATCHES[size] * num_steps),
            global_batch=FIT_BATCHES[size],
            scaling=ScalingConfig(
                num_workers=3,
                cpus_per_worker=0.5,
                shard="full",
                shard_slices=caps,
                shares="equal",
                leave_out_slow=False,
            ),
            run=RunConfig(run_dir=tmp, progress=False, seed=0),
        ).fit(epochs=1)
        held = [w["state_bytes"] for w in result.history[-1]["workers"]]
        return {
            "peaks": read_peaks(peaks),
            "held": held,
            "wall_s": time.perf_counter() - t0,
            "samples_per_s": sum(r["samples"] for r in result.history) / sum(r["wall_s"] for r in result.history),
            "loss": result.history[-1]["last_loss"],
        }


# ---- the driver ------------------------------------------------------------------------------------------
def in_subprocess(runner: str, quick: bool, extra: list[str] | None = None) -> dict:
    cmd = [sys.executable, __file__, "--runner", runner] + (["--quick"] if quick else []) + (extra or [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"{runner} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(values: list[int]) -> str:
    return ", ".join(f"{v / MIB:,.0f}" for v in values)


def speed(quick: bool) -> None:
    cfg = SPEED_MODEL
    params = sum(p.numel() for p in make_model(cfg).parameters())
    print(
        f"## speed: GPT-2 {params / 1e6:.1f}M parameters ({cfg['n_layer']} layers x {cfg['n_embd']}, vocab "
        f"{cfg['vocab']}, seq {cfg['seq']}), global batch {SPEED_BATCH}, AdamW, 2 CPU workers x 1 thread, gloo; "
        f"{STEPS[quick].total} steps, the first {STEPS[quick].warmup} not timed",
        flush=True,
    )
    results = {r: in_subprocess(r, quick) for r in ("fsdp2", "mixtrain-full", "mixtrain-none")}
    base = results["fsdp2"]
    print("| runner | samples/s | vs FSDP2 | peak RSS per worker (MiB) | peak vs FSDP2 (max) |")
    print("|---|---:|---:|---|---:|")
    for runner, out in results.items():
        ratio = out["samples_per_s"] / base["samples_per_s"]
        peak = max(out["peaks"]) / max(base["peaks"])
        print(f"| {runner} | {out['samples_per_s']:.1f} | {ratio:.2f}x | {mib(out['peaks'])} | {peak:.2f}x |")


def fit(quick: bool, size: str) -> None:
    plan = in_subprocess("plan", quick, ["--size", size])
    seq = FIT_MODELS[size]["seq"]
    batch = FIT_BATCHES[size]
    print(f"## fit: {plan['shape']}, seq {seq}, global batch {batch} (micro-batch {batch // 3} per worker)")
    print(f"caps (GB, plan only; nothing enforces them): {plan['caps_gb']}")
    print(plan["table"])
    print(f"plan: fits per level on all three: {plan['fits']}; any single worker alone: {plan['fits_alone']}")
    print(f"plan needs per worker (GB): {plan['needs_gb']}")
    caps = ",".join(str(c) for c in plan["caps_gb"])
    out = in_subprocess("fit", quick, ["--caps", caps, "--size", size])
    print(f"trained {FIT_STEPS[quick]} steps, shard='full', shard_slices={plan['caps_gb']}: {out['wall_s']:.0f} s")
    print(f"final loss {out['loss']:.3f}, {out['samples_per_s']:.2f} samples/s")
    print(
        "| worker | cap (GB) | plan 'full' (MiB) | peak RSS (MiB) | peak / plan "
        "| held: weights / grads / optimizer MiB |"
    )
    print("|---:|---:|---:|---:|---:|---|")
    for r, (cap, pred, peak, held) in enumerate(
        zip(plan["caps_gb"], plan["full_predicted"], out["peaks"], out["held"], strict=True)
    ):
        parts = " / ".join(f"{held[k] / MIB:.0f}" for k in ("weights", "grads", "optimizer"))
        print(f"| {r} | {cap} | {pred / MIB:,.0f} | {peak / MIB:,.0f} | {peak / pred:.2f} | {parts} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--parts", default="speed,fit", help="speed, fit or both")
    parser.add_argument("--size", choices=sorted(FIT_MODELS), default="fit", help="the fit part's model and caps")
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--caps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = STEPS[args.quick]
    if args.runner:
        runners: dict[str, Any] = {
            "fsdp2": lambda: run_fsdp(steps),
            "mixtrain-full": lambda: run_mixtrain("full", steps),
            "mixtrain-none": lambda: run_mixtrain("none", steps),
            "plan": lambda: fit_plan(args.size),
            "fit": lambda: run_fit(args.size, [float(c) for c in args.caps.split(",")], FIT_STEPS[args.quick]),
        }
        print(json.dumps(runners[args.runner]()))
        return
    t0 = time.perf_counter()
    for part in args.parts.split(","):
        if part == "fit":
            fit(args.quick, args.size)
        else:
            speed(args.quick)
    print(f"({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
