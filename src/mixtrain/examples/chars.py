"""A small character-level transformer on Python's own documentation (the `pydoc_data` text that
ships with every CPython: about 465,000 characters of English prose and code). It learns to predict
the next character; the held-out metric is next-character accuracy on the last 10% of the text.

The data is built on every worker from that machine's own Python: each writes the text once as a uint16
token file and reads windows of it through `mixtrain.data.TokenWindows` (one read per window), so nothing is
shipped and a worker holds only the windows it reads. The preflight compares the workers' files.

Command lines:
    mixtrain train chars --workers 2                        # any laptop, ~30 s: held-out next-char accuracy 0.48
    mixtrain train chars --workers 2 --epochs 6 --lr 2e-3
    mixtrain train chars --workers cuda:1,mps:1 --precision auto --address HEAD:6379   # your GPUs
    python -m mixtrain.examples.chars                       # the Python API; prints a sample of text
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mixtrain.data import TokenWindows
from mixtrain.job import Job
from mixtrain.task import Task

DEFAULT_LR = 3e-3
CONTEXT = 64
"""Characters the model sees at once."""


def python_docs_text() -> str:
    """The help topics `help()` shows, as shipped with Python itself (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class CharTransformer(nn.Module):
    """Decoder-only: token and position embeddings, pre-norm causal self-attention blocks, a linear head."""

    def __init__(self, vocab: int, context: int = CONTEXT, width: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.causal: torch.Tensor
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def next_char_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sequence."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_task(vocab: int, lr: float = DEFAULT_LR) -> Task:
    model = CharTransformer(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return Task(model=model, optimizer=optimizer, loss_fn=next_char_loss)


def encode(text: str) -> tuple[np.ndarray, str]:
    """The text as int64 indices into its sorted alphabet, and that alphabet."""
    alphabet = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(alphabet)}
    return np.fromiter((lookup[c] for c in text), dtype=np.int64, count=len(text)), alphabet


def token_file(part: str, max_chars: int, folder: str | None = None) -> Path:
    """Write the text's tokens once (uint16, the first 90% for "train", the rest for "held") and return the
    file: named by the content's hash, so a changed text or setting never reads a stale file."""
    ids, _ = encode(python_docs_text()[:max_chars])
    cut = int(len(ids) * 0.9)
    tokens = (ids[:cut] if part == "train" else ids[cut:]).astype(np.uint16)
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:12]
    path = Path(folder or Path(tempfile.gettempdir()) / "mixtrain-chars") / f"{part}-{digest}.u16"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tokens.tofile(tmp)
        tmp.replace(path)  # atomic: workers on one machine may write it at the same time
    return path


def windows(part: str, max_chars: int, folder: str | None = None) -> TokenWindows:
    """Non-overlapping (input, next characters) windows of CONTEXT characters, read from the token file."""
    return TokenWindows(token_file(part, max_chars, folder), CONTEXT, np.uint16)


def example(lr: float = DEFAULT_LR, seed: int = 0, max_chars: int = 300_000, data_dir: str | None = None) -> Job:
    """Train on the first 90% of `max_chars` characters, hold out the rest (contiguous: no overlap). Each
    worker builds its data from its own Python's text (in `data_dir`, else the temp folder)."""
    _, alphabet = encode(python_docs_text()[:max_chars])
    train = functools.partial(windows, "train", max_chars, data_dir)
    held = functools.partial(windows, "held", max_chars, data_dir)
    return Job(functools.partial(make_task, len(alphabet), lr), train, held, global_batch=64, epochs=3)


@torch.no_grad()
def sample(model: nn.Module, alphabet: str, prompt: str, length: int = 200, temperature: float = 0.8) -> str:
    """Continue `prompt` one character at a time (seeded: the same text every time)."""
    gen = torch.Generator().manual_seed(0)
    lookup = {c: i for i, c in enumerate(alphabet)}
    ids = [lookup[c] for c in prompt if c in lookup]
    model.eval()
    for _ in range(length):
        x = torch.tensor([ids[-CONTEXT:]])
        probs = torch.softmax(model(x)[0, -1] / temperature, -1)
        ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    return "".join(alphabet[i] for i in ids)


def main() -> None:
    from mixtrain import ScalingConfig

    job = example()
    result = job.trainer(scaling=ScalingConfig(num_workers=2)).fit(epochs=job.epochs)
    loss = result.metrics["loss"]
    print(f"held-out accuracy {result.metrics['accuracy']:.4f}, {loss / math.log(2):.2f} bits per character")
    _, alphabet = encode(python_docs_text())
    model = job.task_factory().model
    model.load_state_dict(result.state_dict)
    print(sample(model, alphabet, 'The "for" statement'))


if __name__ == "__main__":
    main()
