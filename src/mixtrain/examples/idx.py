"""The IDX format of the MNIST files (train-images-idx3-ubyte and friends), plain or gzipped.

Layout: two zero bytes, a type code, the number of dimensions, each dimension as a big-endian
uint32, then the values big-endian in C order.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from mixtrain.errors import InputValueError

_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.kind + str(dt.itemsize): code for code, dt in _TYPES.items()}


def read_idx(path: str | Path) -> np.ndarray:
    """The array in an IDX file (`.gz` is decompressed), in native byte order."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _TYPES:
        raise InputValueError(
            f"{path}: not an IDX file (it starts with {data[:4].hex() or 'nothing'}, expected 0000 + type)"
        )
    dtype, ndim = _TYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data[4:header], dtype=">u4"))
    count = int(np.prod(shape)) if shape else 1
    if len(data) != header + count * dtype.itemsize:
        raise InputValueError(
            f"{path}: the header says shape {shape} ({header + count * dtype.itemsize} bytes) but the file has "
            f"{len(data)} bytes; is it truncated?"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write `array` as IDX (gzipped when the name ends in .gz)."""
    path = Path(path)
    array = np.asarray(array)
    code = _CODES.get(array.dtype.kind + str(array.dtype.itemsize))
    if code is None:
        raise InputValueError(f"IDX has no type for {array.dtype}; use uint8, int8, int16, int32, float32 or float64")
    body = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    body += np.ascontiguousarray(array, dtype=_TYPES[code]).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(body)
    return path
