"""What each worker holds at each level of ScalingConfig.shard, on 3 CPU workers with memory slices 3:1:2 and
compute shares by speed: weights, gradients and optimizer state per worker between steps (from the rounds'
records; a block's gathered weights and gradients are transient inside a step), and each fit's wall time.
`python benchmarks/sliced_memory.py` (about a minute and a half on 2 cores)."""

from __future__ import annotations

import tempfile
import time

import torch
from torch import nn

from mixtrain import RunConfig, ScalingConfig, Task, Trainer

WIDTH, DEPTH, SAMPLES, BATCH = 512, 6, 768, 96


def make_task() -> Task:
    layers: list[nn.Module] = [nn.Linear(64, WIDTH)]
    for _ in range(DEPTH):
        layers += [nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 10))
    return Task(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=nn.functional.cross_entropy
    )


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 64, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)
    mib = 2**20
    print(f"MLP {DEPTH} blocks of {WIDTH}: {sum(p.numel() for p in make_task().model.parameters()):,} parameters")
    print("level      | per worker between steps: weights / grads / optimizer MiB | fit wall s (start-up included)")
    for level in ("none", "optimizer", "gradients", "full"):
        with tempfile.TemporaryDirectory() as run_dir:
            t0 = time.perf_counter()
            result = Trainer(
                make_task,
                (x, y),
                global_batch=BATCH,
                scaling=ScalingConfig(
                    num_workers=3,
                    cpus_per_worker=0.5,
                    shard=level,  # type: ignore[arg-type]
                    shard_slices=None if level == "none" else [3, 1, 2],
                    leave_out_slow=False,
                ),
                run=RunConfig(run_dir=run_dir, seed=0, progress=False),
            ).fit(epochs=1)
            wall = time.perf_counter() - t0
        held = [w["state_bytes"] for w in result.history[-1]["workers"]]
        parts = ", ".join("/".join(f"{h[k] / mib:.1f}" for k in ("weights", "grads", "optimizer")) for h in held)
        print(f"{level:10} | {parts} | {wall:.1f}")


if __name__ == "__main__":
    main()
