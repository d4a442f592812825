"""The start-up probe's search for the largest micro-batch that fits, against real OOM exceptions."""

import pytest
import torch

from mixtrain.devices import get
from mixtrain.worker.probe import ProbeError, largest_fitting, samples_per_s, time_steps


def device_with(limit: int):
    """A run(batch) that allocates like a device with room for `limit` samples: past it, torch's own
    OutOfMemoryError (what CUDA raises). Records what it was asked and how often memory was freed."""
    calls: list[int] = []
    freed: list[int] = []

    def run(batch: int) -> None:
        calls.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch} samples")

    return run, calls, freed


@pytest.mark.parametrize("limit,start,cap,expected_lo", [(100, 32, 512, 88), (1000, 32, 512, 512), (5, 32, 512, 5)])
def test_largest_fitting_survives_oom_and_lands_close_below_the_limit(limit, start, cap, expected_lo):
    run, calls, freed = device_with(limit)
    found = largest_fitting(run, start, cap, get("cuda").is_oom, after_oom=lambda: freed.append(1))
    assert expected_lo <= found <= min(limit, cap), (found, calls)
    assert len(freed) == sum(1 for c in calls if c > limit)  # cleaned up after every OOM
    assert len(calls) <= 12


def test_largest_fitting_reraises_other_errors_and_refuses_a_model_that_never_fits():
    def broken(batch: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        largest_fitting(broken, 8, 64, get("cuda").is_oom)
    run, _, _ = device_with(0)
    with pytest.raises(ProbeError, match="micro-batch of 1 sample"):
        largest_fitting(run, 8, 64, get("cuda").is_oom)


def test_mps_oom_message_is_recognised_too():
    run_calls = []

    def run(batch: int) -> None:
        run_calls.append(batch)
        if batch > 20:
            raise RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.2 GB)")

    assert 17 <= largest_fitting(run, 64, 64, get("mps").is_oom) <= 20


def test_time_steps_fills_the_minimum_time_for_fast_steps():
    calls = []
    median = time_steps(lambda b: calls.append(b), 4, repeats=3, warmup=1, min_s=0.0)
    assert len(calls) == 4 and median >= 0.0
    calls.clear()
    time_steps(lambda b: calls.append(b), 4, repeats=3, warmup=0, min_s=10.0, max_repeats=20)
    assert len(calls) == 20


def test_time_steps_takes_off_the_time_a_step_waited_for_a_core():
    # Each call takes 40 ms of wall time; in three of the five timed calls another process held the core for
    # 30 of them. Timed by the wall clock alone the median would be 40 ms; the device's own time is 10 ms.
    import time

    waits = iter([0.0, 0.0, 0.0, 0.03, 0.03, 0.06, 0.06, 0.06, 0.06, 0.09])
    seen = {"wait": 0.0}

    def run(batch: int) -> None:
        time.sleep(0.04)

    def waited() -> float:
        seen["wait"] = next(waits)
        return seen["wait"]

    median = time_steps(run, 4, repeats=5, warmup=0, min_s=0.0, waited=waited)
    assert 0.008 <= median <= 0.02, median


def test_a_cpu_share_reads_this_threads_wait_for_a_core_where_linux_tells_it():
    from mixtrain.devices.cpu import CpuShare

    share = CpuShare()
    first = share.waited_s()
    assert first >= 0.0 and share.waited_s() >= first
    share.close()
    assert CpuShare(enabled=False).waited_s() == 0.0


def test_the_probe_counts_loading_once_per_sample_on_top_of_the_compute():
    # 32 samples: 0.1 s of compute for the step, 5 ms to load each sample (measured once)
    assert samples_per_s(32, 0.1, 0.005) == pytest.approx(32 / (0.1 + 0.16))
    assert samples_per_s(32, 0.1, 0.0) == pytest.approx(320.0)  # in-memory data: the compute alone
    with pytest.raises(ValueError, match="batch=0"):
        samples_per_s(0, 0.1, 0.0)
