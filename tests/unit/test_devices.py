"""Device classes and the detect order, with torch's availability functions patched (no GPU here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from mixtrain import devices


@pytest.fixture
def cuda_box(monkeypatch):
    """Pretend this machine has two Ampere CUDA GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"NVIDIA A100 #{i}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (30 * 2**30, 40 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(uuid=f"GPU-{i}"))


@pytest.fixture
def mac(monkeypatch):
    """Pretend this machine is an Apple Silicon Mac: MPS available, no CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * 2**30)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2**30)
    monkeypatch.setattr(devices.MpsDevice, "supports_bf16", lambda self, i=0: True)
    monkeypatch.setattr("mixtrain.devices.mps._chip", lambda: "Apple M2 Pro")


def test_cpu_only_machine_resolves_everything_to_cpu_and_refuses_a_gpu():
    assert devices.detect() == "cpu"
    assert devices.resolve("auto").kind == "cpu"
    assert devices.resolve("cpu").torch_device() == torch.device("cpu")
    with pytest.raises(devices.DeviceUnavailableError, match="asked for a GPU but neither CUDA nor MPS"):
        devices.resolve("gpu")
    with pytest.raises(devices.DeviceUnavailableError, match="asked for a cuda device"):
        devices.resolve("cuda")
    [cpu] = devices.local_devices()
    assert cpu.kind == "cpu" and cpu.total_memory and cpu.free_memory and cpu.bf16 and not cpu.fp16


def test_cuda_is_first_in_the_detect_order(cuda_box):
    assert devices.detect() == "cuda"
    assert devices.resolve("gpu").kind == "cuda"
    kinds = [(d.kind, d.index) for d in devices.local_devices()]
    assert kinds == [("cuda", 0), ("cuda", 1), ("cpu", 0)]
    info = devices.get("cuda").info(1)
    assert info.name == "NVIDIA A100 #1" and info.total_memory == 40 * 2**30 and info.free_memory == 30 * 2**30
    assert info.bf16 and info.fp16
    assert info.uuid == "GPU-1"  # two workers on one card share it: NCCL is not used between them


def test_a_gpu_request_on_a_mac_resolves_to_mps(mac):
    assert devices.detect() == "mps"
    dev = devices.resolve("gpu")
    assert dev.kind == "mps" and dev.torch_device() == torch.device("mps", 0)
    info = dev.info()
    assert info.name == "Apple M2 Pro GPU (MPS)"
    assert info.total_memory == 16 * 2**30 and info.free_memory == 15 * 2**30


def test_old_gpus_have_no_bf16(cuda_box, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    assert not devices.get("cuda").supports_bf16()


def test_each_kind_knows_its_out_of_memory_error():
    assert devices.get("cuda").is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert devices.get("mps").is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert devices.get("cpu").is_oom(MemoryError())
    assert not devices.get("cuda").is_oom(RuntimeError("shape mismatch"))
    assert not devices.get("mps").is_oom(RuntimeError("CUDA out of memory"))


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="device kind 'tpu': use one of cuda, mps, cpu"):
        devices.get("tpu")


def test_each_kind_owns_its_cache_and_random_stream(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda.empty_cache"))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i=0: torch.tensor([i, 7], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i=0: calls.append(("cuda.set", s.tolist(), i)))
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: calls.append("mps.empty_cache"))
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: torch.tensor([9], dtype=torch.uint8))
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: calls.append(("mps.set", s.tolist())))
    cuda, mps, cpu = devices.get("cuda"), devices.get("mps"), devices.get("cpu")
    cuda.empty_cache(), mps.empty_cache(), cpu.empty_cache()
    assert cuda.rng_state(1).tolist() == [1, 7] and mps.rng_state().tolist() == [9] and cpu.rng_state() is None
    cuda.set_rng_state(torch.tensor([3], dtype=torch.uint8), 1)
    mps.set_rng_state(torch.tensor([4], dtype=torch.uint8))
    cpu.set_rng_state(torch.tensor([5], dtype=torch.uint8))  # the CPU stream is torch's own: nothing to do
    assert calls == ["cuda.empty_cache", "mps.empty_cache", ("cuda.set", [3], 1), ("mps.set", [4])]


def test_each_kind_answers_the_capability_questions_the_worker_asks():
    cpu, cuda, mps = devices.get("cpu"), devices.get("cuda"), devices.get("mps")
    assert [k.supports_float64 for k in (cpu, cuda, mps)] == [True, True, False]
    assert [k.probes_memory for k in (cpu, cuda, mps)] == [False, True, True]
    assert [k.has_own_random_stream for k in (cpu, cuda, mps)] == [False, True, True]
    assert [k.auto_low_precision for k in (cpu, cuda, mps)] == [False, True, True]


def test_make_current_sets_the_cuda_device_and_is_a_no_op_elsewhere(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    devices.get("cuda").make_current(1)
    devices.get("cpu").make_current(0)
    devices.get("mps").make_current(0)
    assert chosen == [1]


# ---- issue 18, item 7: copies to MPS and finite checks on MPS (no Mac here: torch's MPS side is not run) ----
def test_batches_go_to_mps_with_blocking_copies_and_to_cuda_non_blocking():
    # A non-blocking copy to MPS from a CPU batch that is freed before the stream syncs can land corrupted
    # (pytorch#189690). Mock(spec=Tensor) passes isinstance checks and records how .to was called.
    from unittest import mock

    from mixtrain.data.sources import to_device

    for device, non_blocking in ((torch.device("mps"), False), (torch.device("cuda", 0), True)):
        x, y = mock.Mock(spec=torch.Tensor), mock.Mock(spec=torch.Tensor)
        to_device({"x": x, "pair": (y, 3)}, device)
        x.to.assert_called_once_with(device, non_blocking=non_blocking)
        y.to.assert_called_once_with(device, non_blocking=non_blocking)
    assert devices.get("mps").non_blocking_copies is False and devices.get("cpu").non_blocking_copies is False


def test_no_copy_in_mixtrain_is_non_blocking_unless_the_device_allows_it():
    from tests.conftest import REPO

    literal = [p for p in (REPO / "src" / "mixtrain").rglob("*.py") if "non_blocking=True" in p.read_text()]
    assert literal == []


def test_finite_checks_cover_at_most_the_devices_reduction_limit(monkeypatch):
    # MPS `any`/`all` are wrong past 2**31 - 1 elements: each check covers at most that many. Shown here with
    # the CPU's limit shrunk to 10 elements, and every isfinite call's size recorded.
    assert devices.get("mps").max_reduce_numel == 2**31 - 1 and devices.get("cpu").max_reduce_numel is None
    monkeypatch.setattr(devices.get("cpu"), "max_reduce_numel", 10)
    sizes = []
    real = torch.isfinite

    def spy(t):
        sizes.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    t = torch.zeros(2, 15)
    assert devices.all_finite([t, torch.ones(3)])
    t[1, 10] = float("nan")  # element 25: in the third slice
    assert not devices.all_finite([torch.ones(3), t])
    assert sizes and max(sizes) <= 10
    assert not devices.all_finite([torch.tensor([1.0, float("inf")])]) and devices.all_finite([torch.zeros(0)])


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux schedstat")
def test_the_cpu_share_counts_waiting_for_a_core_but_not_sleeping():
    """A thread pinned to a core two busy processes also hold gets about a third of it; asleep it waits for
    nothing. Real processes, real scheduler."""
    from mixtrain.devices.cpu import SCHEDSTAT, CpuShare, run_and_wait_ns

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    fd = os.open(SCHEDSTAT, os.O_RDONLY)
    try:
        ran, waited = run_and_wait_ns(fd) or (0, 0)
        time.sleep(0.3)
        after = run_and_wait_ns(fd)
    finally:
        os.close(fd)
    assert after is not None and after[1] - waited < 0.1e9 and after[0] - ran < 0.1e9  # asleep: neither counts
    before = os.sched_getaffinity(0)
    core = min(before)
    hogs = [
        subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
        for _ in range(2)
    ]
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.3)  # the busy processes are running
        busy = CpuShare()
        busy.start()
        spin(1.0)
        busy.stop()
        share = busy.close()
    finally:
        os.sched_setaffinity(0, before)
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert share is not None and share[0] < 0.6 and share[1] > 0.4, share  # under 60% of a core; 0.4 s waiting


def test_the_cpu_share_is_none_where_the_os_does_not_tell_or_when_not_asked(monkeypatch):
    from mixtrain.devices import cpu

    unasked = cpu.CpuShare(enabled=False)
    unasked.start()
    unasked.stop()
    assert unasked.close() is None
    monkeypatch.setattr(cpu, "SCHEDSTAT", "/proc/no-such-file")
    share = cpu.CpuShare()
    share.start()
    share.stop()
    assert share.close() is None
