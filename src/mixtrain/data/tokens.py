"""Next-token training over a token file far larger than memory: windows read from a memory map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch


class TokenWindows:
    """Windows of `context` tokens from a flat binary token file (e.g. uint16, as numpy's `tofile` writes
    it): sample i is (tokens[i*context : (i+1)*context], the same shifted by one), as int64 tensors.

    The file is memory-mapped where it is first read, so pickling this dataset carries only the path, and a
    worker's resident memory grows with the windows it reads, not with the file's size."""

    def __init__(self, path: str | Path, context: int, dtype: Any = np.uint16) -> None:
        self.path = str(path)
        self.context = int(context)
        self.dtype = np.dtype(dtype)
        if self.context < 1:
            raise ValueError(f"TokenWindows(context={context!r}): must be >= 1")
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"TokenWindows: no token file at {self.path}")
        num_tokens = Path(self.path).stat().st_size // self.dtype.itemsize
        self._len = (num_tokens - 1) // self.context
        if self._len < 1:
            raise ValueError(
                f"TokenWindows: {self.path} holds {num_tokens} tokens of {self.dtype}, too few for one window of "
                f"{self.context} (+1) tokens"
            )
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} of {self._len}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.context
        window = torch.from_numpy(self._tokens[start : start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}  # the map is opened again where the dataset lands
