"""Next-token training over a token file far larger than memory: each window read on its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixtrain.errors import InputValueError


class TokenWindows:
    """Windows of `context` tokens from a flat binary token file (e.g. uint16, as numpy's `tofile` writes
    it): sample i is (tokens[i*context : (i+1)*context], the same shifted by one), as int64 tensors.

    Each window is one positioned read of the file (`os.pread`; a read-only memory map where the platform
    has no pread), opened where the dataset is first read: pickling it carries only the path, and a
    worker's memory grows with the windows it holds, not with the file's size nor with the pages around
    what it read."""

    def __init__(self, path: str | Path, context: int, dtype: Any = np.uint16) -> None:
        self.path = str(path)
        self.context = int(context)
        self.dtype = np.dtype(dtype)
        if self.context < 1:
            raise InputValueError(f"TokenWindows(context={context!r}): must be >= 1")
        if not Path(self.path).is_file():
            raise FileNotFoundError(f"TokenWindows: no token file at {self.path}")
        num_tokens = Path(self.path).stat().st_size // self.dtype.itemsize
        self._len = (num_tokens - 1) // self.context
        if self._len < 1:
            raise InputValueError(
                f"TokenWindows: {self.path} holds {num_tokens} tokens of {self.dtype}, too few for one window of "
                f"{self.context} (+1) tokens"
            )
        self._fd: int | None = None
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} of {self._len}")
        window = torch.from_numpy(self._read(index * self.context, self.context + 1).astype(np.int64))
        return window[:-1], window[1:]

    def _read(self, start: int, count: int) -> np.ndarray:
        size = self.dtype.itemsize
        if hasattr(os, "pread"):
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return np.frombuffer(os.pread(self._fd, count * size, start * size), dtype=self.dtype)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        return np.asarray(self._map[start : start + count])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None, "_map": None}  # opened again where the dataset lands

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]
