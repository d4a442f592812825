"""A small CNN on MNIST, from the four IDX files you already have (mixtrain downloads nothing).

The folder must hold train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
t10k-labels-idx1-ubyte, each plain or as .gz (the names the MNIST and Fashion-MNIST sites use).

Command lines:
    mixtrain train mnist --data-dir ~/data/mnist --workers 2
    mixtrain train mnist --data-dir ~/data/mnist --workers cuda:1,cpu:1 --precision auto --epochs 3
    python -m mixtrain.examples.mnist ~/data/mnist           # the Python API
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch import nn

from mixtrain.errors import InputValueError
from mixtrain.examples.idx import read_idx
from mixtrain.job import Job
from mixtrain.task import Task

DEFAULT_LR = 1e-3
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class MnistCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_task(lr: float = DEFAULT_LR) -> Task:
    model = MnistCNN()
    return Task(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr), loss_fn=nn.functional.cross_entropy)


def _find(folder: Path, name: str) -> Path:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise InputValueError(
        f"--data-dir {str(folder)!r}: no {name} or {name}.gz there; the folder needs the four MNIST IDX files "
        f"({', '.join(FILES.values())})"
    )


def load_mnist(data_dir: str | Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test): images as (N, 1, 28, 28) float32 in [0, 1], labels int64."""
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise InputValueError(f"--data-dir {str(data_dir)!r}: no such folder")
    arrays = {key: read_idx(_find(folder, name)) for key, name in FILES.items()}
    out = []
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or len(images) != len(labels):
            raise InputValueError(
                f"--data-dir {str(data_dir)!r}: {part} images have shape {images.shape} and labels {labels.shape}; "
                "expected (N, 28, 28) and (N,)"
            )
        x = torch.from_numpy(images.astype("float32") / 255.0).unsqueeze(1)
        out.append((x, torch.from_numpy(labels.astype("int64"))))
    return out[0], out[1]


def example(data_dir: str | None = None, lr: float = DEFAULT_LR) -> Job:
    if data_dir is None:
        raise InputValueError(
            "the mnist example needs --data-dir DIR: a folder with the four MNIST IDX files "
            f"({', '.join(FILES.values())}, plain or .gz); mixtrain downloads nothing"
        )
    train, test = load_mnist(data_dir)
    return Job(functools.partial(make_task, lr), train, test, global_batch=128, epochs=2)


def main(data_dir: str) -> None:
    from mixtrain import ScalingConfig

    job = example(data_dir)
    result = job.trainer(scaling=ScalingConfig(num_workers=2)).fit(epochs=job.epochs)
    print(f"test accuracy {result.metrics['accuracy']:.4f}; files in {result.run_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
