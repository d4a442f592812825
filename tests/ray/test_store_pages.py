"""A worker hands back the object store's pages it touched (comm/store_pages.py): real objects in a real store."""

import numpy as np
import pytest
import ray

from mixtrain.comm.store_pages import MIN_LIMIT_BYTES, StorePages, store_ranges, two_steps
from mixtrain.devices.cpu import status_bytes

pytestmark = pytest.mark.usefixtures("ray_session")
MB = 2**20


@ray.remote(num_cpus=0)
class Reader:
    def read_and_release(self, array: np.ndarray, limit_mb: float) -> dict:
        def held() -> int:
            with open("/proc/self/status") as f:
                return status_bytes(f.read(), "RssShmem") or 0

        total = float(array.sum())  # touches every page of the object (read zero-copy from the store)
        before = held()
        pages = StorePages(int(limit_mb * MB))
        released = pages.release_if_over()
        after = held()
        again = float(array.sum())  # the object is still there: its pages fault back in from the store
        return {"before": before, "after": after, "released": released, "sums": [total, again]}


def test_a_worker_hands_back_store_pages_it_read_and_the_object_reads_the_same_afterwards():
    array = np.arange(16 * MB // 4, dtype=np.float32) % 1000  # 16 MB, in the object store
    reader = Reader.remote()
    # under the limit: nothing happens
    kept = ray.get(reader.read_and_release.remote(array, 64.0))
    assert not kept["released"] and kept["after"] >= 15 * MB, kept
    # over it: the pages go from this process, the object does not
    got = ray.get(reader.read_and_release.remote(array, 1.0))
    assert got["before"] >= 15 * MB and got["released"], got
    assert got["after"] < got["before"] - 15 * MB, got
    expected = float(array.sum())
    assert got["sums"] == [expected, expected]
    ray.kill(reader)


def test_the_store_mapping_and_shared_pages_are_read_from_procfs_texts():
    maps = (
        "55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f4894e60000-7f4a54000000 rw-s 00000000 00:1b 3006                       /dev/shm/plasmaczgVps (deleted)\n"
        "7f4a54000000-7f4a55000000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6\n"
    )
    assert store_ranges(maps) == [(0x7F4894E60000, 0x7F4A54000000)]
    assert status_bytes("VmRSS:\t  305912 kB\nRssShmem:\t  195316 kB\n", "RssShmem") == 195316 * 1024
    assert status_bytes("VmRSS:\t 1 kB\n", "RssShmem") is None
    assert two_steps(100 * MB) == 200 * MB and two_steps(1) == MIN_LIMIT_BYTES == 32 * MB
