"""Where a sliced worker's peak memory goes: benchmarks/sliced.py's 3-worker "fit" run (a 67.3M GPT-2, caps
1.46 / 0.91 / 1.09 GB, shard="full"), with each worker's RSS, its peak (VmHWM), glibc's heap in use and free
(mallinfo2), its page faults and CPU time sampled every 50 ms, then the largest of each per phase (build, the
probe and the group's forming, each step). docs/benchmarks.md's "where the peak was" came from it.

Command lines (Linux with glibc; about 2 minutes on 2 busy cores):
    python benchmarks/sliced_profile.py                       # shard="full", 6 steps
    python benchmarks/sliced_profile.py --level gradients
    python benchmarks/sliced_profile.py --size issue --steps 4   # the issue's 148M decoder, caps 2.0/1.25/1.5 GB
    MIXTRAIN_SLICED_MMAP_THRESHOLD_MB=0 python benchmarks/sliced_profile.py    # the heap as before (issue 48)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from ray import cloudpickle as ray_cloudpickle

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import benchmarks.sliced  # noqa: E402
from benchmarks.sliced import CAP_RATIOS, FIT_BATCHES, FIT_MODELS, make_model  # noqa: E402  (its "fit" run's)

# the workers get make_model with the task (pickled by value), whatever folder this runs from
ray_cloudpickle.register_pickle_by_value(benchmarks.sliced)

CAPS = {"fit": [1.46, 0.91, 1.09], "issue": list(CAP_RATIOS)}
"""benchmarks/sliced.py's caps for each --size (what its plan part prints), as shard_slices."""


MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


def sample() -> dict[str, Any]:
    """This process now: RSS and peak RSS, heap in use and free (MiB), page faults, CPU seconds."""

    fields = [(n, ctypes.c_size_t) for n in MALLINFO2]  # made here: the task's factory travels pickled
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = type("MallInfo2", (ctypes.Structure,), {"_fields_": fields})
    m = libc.mallinfo2()
    out: dict[str, Any] = {"used": (m.uordblks + m.hblkhd) >> 20, "free": m.fordblks >> 20}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            out[line.split(":")[0]] = int(line.split()[1]) // 1024
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    out["faults"], out["cpu"] = int(stat[7]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return out


class Recorder:
    """Appends samples and events to one file per worker process (folder/PID.jsonl)."""

    def __init__(self, folder: str, size: str) -> None:
        self.folder = folder
        self.size = size

    def log(self, event: str, **extra: Any) -> None:
        line = json.dumps({"t": time.time(), "ev": event, **sample(), **extra})
        with open(Path(self.folder, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")

    def sample_forever(self) -> None:
        while True:
            self.log("sample")
            time.sleep(0.05)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.log("forward", grad=torch.is_grad_enabled())
        return model(input_ids=batch[0], labels=batch[1]).loss

    def task(self) -> Any:
        from mixtrain import Task

        threading.Thread(target=self.sample_forever, daemon=True).start()
        self.log("build")
        model = make_model(FIT_MODELS[self.size])
        return Task(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), compute_loss=self.loss)


def phases(records: list[dict]) -> list[tuple[str, list[dict]]]:
    """The records cut where the build starts, the first forward pass without gradients (the probe) starts, and
    each training step's first forward pass starts (one micro-batch a step here)."""
    cuts: list[tuple[str, list[dict]]] = [("start", [])]
    steps = 0
    for r in records:
        if r["ev"] == "build":
            cuts.append(("build", []))
        elif r["ev"] == "forward" and not r["grad"] and cuts[-1][0] == "build":
            cuts.append(("probe+form", []))
        elif r["ev"] == "forward" and r["grad"]:
            steps += 1
            cuts.append((f"step {steps}", []))
        cuts[-1][1].append(r)
    return [(name, rs) for name, rs in cuts if rs]


def report(folder: str) -> None:
    for path in sorted(Path(folder).glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        print(f"worker pid {path.stem}: peak RSS {records[-1]['VmHWM']:,} MiB")
        print("  phase        max RSS  (heap used / free then)  max heap used  page faults  CPU s")
        for name, rs in phases(records):
            top = max(rs, key=lambda r: r["VmRSS"])
            faults, cpu = rs[-1]["faults"] - rs[0]["faults"], rs[-1]["cpu"] - rs[0]["cpu"]
            used = max(r["used"] for r in rs)
            print(
                f"  {name:11s} {top['VmRSS']:7,}  ({top['used']:5,} / {top['free']:5,})"
                f"  {used:13,}  {faults:11,}  {cpu:5.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", default="full", choices=["gradients", "full"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", choices=sorted(FIT_MODELS), default="fit", help="benchmarks/sliced.py's --size")
    args = parser.parse_args()
    from mixtrain import RunConfig, ScalingConfig, Trainer

    seeded = torch.Generator().manual_seed(0)
    cfg, batch = FIT_MODELS[args.size], FIT_BATCHES[args.size]
    ids = torch.randint(0, cfg["vocab"], (batch * args.steps, cfg["seq"]), generator=seeded)
    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory() as folder:
        Trainer(
            Recorder(folder, args.size).task,
            (ids, ids),
            global_batch=batch,
            scaling=ScalingConfig(
                num_workers=3,
                cpus_per_worker=0.5,
                shard=args.level,
                shard_slices=CAPS[args.size],
                shares="equal",
                leave_out_slow=False,
            ),
            run=RunConfig(run_dir=run_dir, progress=False, seed=0),
        ).fit(epochs=1)
        report(folder)


if __name__ == "__main__":
    main()
