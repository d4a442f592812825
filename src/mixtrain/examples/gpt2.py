"""A Hugging Face `transformers` GPT-2, built from a config (nothing is downloaded), trained on dict
batches with `compute_loss`: the same Python-documentation text as the `chars` example, one token per
character, read on each worker from its own token file through `TokenWindows`.

Needs the optional extra: `pip install "mixtrain[hf]"`.

Command lines:
    mixtrain train mixtrain.examples.gpt2:example --workers 2             # any laptop, about a minute
    mixtrain train mixtrain.examples.gpt2:example --workers cuda:1,mps:1 --precision auto --address HEAD:6379
    python -m mixtrain.examples.gpt2                                       # the Python API
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from mixtrain.data import TokenWindows
from mixtrain.examples.chars import CONTEXT, encode, python_docs_text, token_file
from mixtrain.job import Job
from mixtrain.task import Task

DEFAULT_LR = 3e-3


class DictWindows(torch.utils.data.Dataset):
    """TokenWindows as the dicts a Hugging Face causal LM takes: input_ids and labels (it shifts them)."""

    def __init__(self, windows: TokenWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, _ = self.windows[i]
        return {"input_ids": ids, "labels": ids}


def gpt2_windows(part: str, max_chars: int, folder: str | None = None) -> DictWindows:
    return DictWindows(TokenWindows(token_file(part, max_chars, folder), CONTEXT))


def lm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The mean next-token cross-entropy the model computes itself from `labels`."""
    return model(**batch).loss


def make_task(vocab: int, lr: float = DEFAULT_LR) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=CONTEXT,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return Task(model=model, optimizer=optimizer, compute_loss=lm_loss, max_grad_norm=1.0)


def example(lr: float = DEFAULT_LR, seed: int = 0, max_chars: int = 300_000, data_dir: str | None = None) -> Job:
    """GPT-2 on the first 90% of `max_chars` characters, the rest held out; data built on each worker."""
    _, alphabet = encode(python_docs_text()[:max_chars])
    train = functools.partial(gpt2_windows, "train", max_chars, data_dir)
    held = functools.partial(gpt2_windows, "held", max_chars, data_dir)
    return Job(functools.partial(make_task, len(alphabet), lr), train, held, global_batch=64, epochs=3)


def uniform_loss(job: Job) -> float:
    """The loss of guessing every character uniformly (what training must beat)."""
    model: Any = job.task_factory().model
    return math.log(model.config.vocab_size)


def main() -> None:
    from mixtrain import ScalingConfig

    job = example()
    result = job.trainer(scaling=ScalingConfig(num_workers=2)).fit(epochs=job.epochs)
    loss = result.metrics["loss"]
    print(
        f"held-out loss {loss:.4f} nats ({loss / math.log(2):.2f} bits per character; uniform {uniform_loss(job):.2f})"
    )


if __name__ == "__main__":
    main()
