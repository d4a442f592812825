"""A peft LoRA GPT-2 through mixtrain: what a checkpoint holds against the adapters and their optimizer state, and
what the all-reduce sends per step against the adapters' gradients (the frozen base has none to exchange).

Command lines:
    python benchmarks/lora.py                       # GPT-2 n_embd=256, 4 layers, LoRA r=8 on c_attn: ~1 minute
    python benchmarks/lora.py --n-embd 512 --layers 8 --rank 16

The model is built from a config (nothing downloaded), 2 CPU workers with shares 40/24 of a global batch of 64,
AdamW over the adapters, 2 rounds of 3 steps and a checkpoint at the end. Bytes on disk are the checkpoint
folder's files (manifest included); bytes sent are WorkerReport.sent_bytes per worker, from the run's history.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
CONTEXT = 32
B = 64
N = 64 * 6


def _task(n_embd: int, layers: int, rank: int) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from mixtrain import Task

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=n_embd, n_layer=layers, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=rank, target_modules=["c_attn"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return Task(model=model, optimizer=opt, compute_loss=lambda m, b: m(input_ids=b[0], labels=b[1]).loss)


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def main() -> None:
    from mixtrain import RunConfig, ScalingConfig, Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    factory = functools.partial(_task, args.n_embd, args.layers, args.rank)
    model = factory().model
    adapters = _bytes(p for p in model.parameters() if p.requires_grad)
    base = _bytes(p for p in model.parameters() if not p.requires_grad)
    ids = torch.randint(0, VOCAB, (N, CONTEXT), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        result = Trainer(
            factory,
            (ids, ids.clone()),
            global_batch=B,
            scaling=ScalingConfig(num_workers=2, shares=[40, 24]),
            run=RunConfig(run_dir=tmp, seed=0, steps_per_round=3, progress=False),
        ).fit(epochs=1)
        checkpoint = sorted((Path(tmp) / "checkpoints").glob("step-*"))[-1]
        on_disk = {f.name: f.stat().st_size for f in checkpoint.iterdir()}
        folder = {f.name: f.stat().st_size for f in (Path(tmp) / "hf_model").iterdir()}
    steps = sum(r["num_steps"] for r in result.history)
    sent = [sum(w["sent_bytes"] for w in r["workers"]) / len(r["workers"]) for r in result.history]
    print(f"model: GPT-2 n_embd={args.n_embd} layers={args.layers}, LoRA r={args.rank} on c_attn")
    print(f"frozen base: {base:,} bytes; adapters: {adapters:,} bytes; adapters + AdamW state: {3 * adapters:,} bytes")
    print(f"checkpoint on disk: {sum(on_disk.values()):,} bytes ({sum(on_disk.values()) / (3 * adapters):.3f}x the "
          f"adapters + their AdamW state; whole model + state would be {base + 3 * adapters:,}) {on_disk}")  # fmt: skip
    print(f"hf_model (adapter folder): {folder}")
    per_step = sum(sent) / steps
    print(f"sent per worker per step: {per_step:,.0f} bytes ({per_step / adapters:.3f}x the adapters' gradients; "
          f"the whole model's gradients would be {base + adapters:,})")  # fmt: skip


if __name__ == "__main__":
    main()
