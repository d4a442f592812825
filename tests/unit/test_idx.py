"""The MNIST IDX reader on files the tests write."""

import gzip

import numpy as np
import pytest

from mixtrain.examples.idx import read_idx, write_idx


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28),
        np.array([7, 2, 1, 0, 4], dtype=np.uint8),
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        np.array([[-5, 300], [70000, -1]], dtype=np.int32),
        np.array([-3, 4], dtype=np.int16),
        np.array([1.5, -2.25], dtype=np.float64),
        np.array([-1, 1], dtype=np.int8),
    ],
)
def test_round_trip(tmp_path, array, suffix):
    path = write_idx(tmp_path / f"a-idx{suffix}", array)
    back = read_idx(path)
    assert back.dtype == array.dtype.newbyteorder("=") and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_the_bytes_are_the_published_layout(tmp_path):
    """What the MNIST site documents: magic 0x00000801 for labels, a big-endian count, then the bytes."""
    path = write_idx(tmp_path / "labels", np.array([5, 0, 4], dtype=np.uint8))
    assert path.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 5, 0, 4])
    images = write_idx(tmp_path / "images", np.zeros((1, 2, 3), dtype=np.uint8)).read_bytes()
    assert images[:16] == bytes([0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3])


def test_a_truncated_or_foreign_file_is_named(tmp_path):
    path = write_idx(tmp_path / "t", np.zeros((4, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="is it truncated"):
        read_idx(path)
    other = tmp_path / "x.gz"
    with gzip.open(other, "wb") as f:
        f.write(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(other)
