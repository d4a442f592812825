"""A GPT-2 of width 2048 (GPT-2 XL's layer, GPT-2's vocabulary) for `mixtrain plan --devices`: two blocks are built
and measured on the CPU (about 205M parameters, 3-4 GB of memory while measuring), and `--blocks 18` predicts the
same shape with 18 blocks: about 1.0B parameters. Nothing is downloaded; the samples are random token ids.

Command line (from the repository's root):
    mixtrain plan docs.examples.gpt2_1b_shape:job --devices cuda:12GB,mps:16GB --link 1gbit --blocks 18
"""

from __future__ import annotations

import torch

from mixtrain import Job, Task

CONTEXT = 256
"""Tokens per sample in the measurement (activations grow with it)."""


def make_task() -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=2048, n_head=16, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    return Task(model=model, optimizer=optimizer, compute_loss=lambda m, b: m(**b).loss)


def job(seed: int = 0) -> Job:
    ids = torch.randint(0, 50257, (4, CONTEXT), generator=torch.Generator().manual_seed(seed))
    samples = [{"input_ids": row, "labels": row} for row in ids]
    return Job(make_task, samples, global_batch=32)
