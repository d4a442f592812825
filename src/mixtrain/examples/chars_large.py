"""The big-model recipe on a laptop: a 25M-parameter character transformer on Python's own documentation,
trained with every memory saver mixtrain has. Memory, not speed, decides which model a MacBook or a
12 GB card can train; this example is sized so that it matters:

- activation checkpointing on the transformer blocks (`Task(activation_checkpointing=...)`): a block's
  activations are recomputed in backward instead of kept, the same gradients for ~30% more compute;
- the optimizer state sharded by memory (`--shard-optimizer`): AdamW's two moments (2x the weights) are
  split over the workers by their free memory instead of held in full by each;
- bf16/fp16 autocast on GPUs (`--precision auto`); weights and optimizer state stay fp32.

The text and token files are the `chars` example's (no download). By default it trains on the first
60,000 characters only (a few minutes on a CPU): the point is the memory per worker, which the run prints
after its first round ("memory per worker: ...") and records in metrics.jsonl.

Command lines:
    mixtrain train chars-large --workers 2 --shard-optimizer        # any laptop: memory per worker, ~3 min
    mixtrain train chars-large --workers 2                          # the same without sharding, to compare
    mixtrain train chars-large --workers cuda:1,mps:1 --precision auto --shard-optimizer --address HEAD:6379
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mixtrain.examples.chars import CharTransformer, encode, next_char_loss, python_docs_text, windows
from mixtrain.job import Job
from mixtrain.task import Task

DEFAULT_LR = 1e-3
WIDTH, LAYERS, HEADS = 512, 8, 8
"""25.3M parameters: 8 pre-norm blocks of width 512 (12 x 512^2 weights each) and the embeddings."""


def make_task(vocab: int, lr: float = DEFAULT_LR, checkpointing: bool = True) -> Task:
    model = CharTransformer(vocab, width=WIDTH, layers=LAYERS, heads=HEADS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return Task(
        model=model,
        optimizer=optimizer,
        loss_fn=next_char_loss,
        max_grad_norm=1.0,
        activation_checkpointing=(nn.TransformerEncoderLayer,) if checkpointing else (),
    )


def example(
    lr: float = DEFAULT_LR,
    seed: int = 0,
    max_chars: int = 60_000,
    checkpointing: bool = True,
    data_dir: str | None = None,
) -> Job:
    """`max_chars` of the documentation (90% train, 10% held out); `checkpointing=False` keeps every
    activation (a TOML `[args]` entry), to see what checkpointing saves."""
    _, alphabet = encode(python_docs_text()[:max_chars])
    train = functools.partial(windows, "train", max_chars, data_dir)
    held = functools.partial(windows, "held", max_chars, data_dir)
    factory = functools.partial(make_task, len(alphabet), lr, checkpointing)
    return Job(factory, train, held, global_batch=32, epochs=1)
