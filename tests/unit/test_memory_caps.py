"""DeviceGroup(memory=...) kept to: the CUDA and MPS allocators hold a worker's tensors to its figure (torch's
functions patched: no GPU and no Mac here), the CPU cannot, so the driver names a worker whose peak passes it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mixtrain.devices import get
from mixtrain.driver.caps import CapWatch
from mixtrain.records.rounds import RoundRecord, WorkerRound


def test_cuda_holds_the_process_to_its_cap_as_a_fraction_of_the_card(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append((f, i)))
    assert get("cuda").cap_memory(4 * 2**30, 1) is True
    assert get("cuda").cap_memory(32 * 2**30, 0) is True  # more than the card: the whole card
    assert get("cuda").cap_memory(None, 1) is True  # no cap (a kept worker's next fit): the whole card again
    assert calls == [(0.25, 1), (1.0, 0), (1.0, 1)]


def test_mps_holds_the_process_to_its_cap_as_a_fraction_of_the_working_set(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * 2**30)
    monkeypatch.setattr(torch.mps, "set_per_process_memory_fraction", lambda f: calls.append(f))
    assert get("mps").cap_memory(3 * 2**30) is True
    assert get("mps").cap_memory(48 * 2**30) is True  # MPS takes at most 2.0
    assert calls == [0.25, 2.0]


def test_the_cpu_cannot_hold_a_process_to_a_figure():
    assert get("cpu").cap_memory(2**30) is False and get("cpu").cap_memory(None) is False


class _Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []
        self.lines: list[str] = []

    def write(self, kind: str, record: dict) -> None:
        self.records.append((kind, record))

    def log(self, line: str) -> None:
        self.lines.append(line)


def _round(*peaks: int | None) -> RoundRecord:
    workers = [
        WorkerRound(
            compute_s=1.0,
            wait_s=0.0,
            comm_s=0.0,
            samples=8,
            sent_bytes=0,
            max_staleness=0,
            cpu_share=None,
            cpu_wait_s=0.0,
            memory_bytes=peak,
            state_bytes={},
        )
        for peak in peaks
    ]
    return RoundRecord(
        epoch=0,
        first_step=0,
        num_steps=1,
        samples=8 * len(peaks),
        loss=1.0,
        last_loss=1.0,
        samples_per_s=1.0,
        wall_s=1.0,
        skipped_steps=[],
        nonfinite_steps=[],
        drift=0.0,
        rebroadcast=False,
        shares=[8] * len(peaks),
        grad_norm=None,
        workers=workers,
    )


@pytest.mark.parametrize("caps", [None, ()])
def test_no_caps_no_words(caps):
    out = _Log()
    CapWatch(caps, out, out).after_round(_round(10**12), [0])  # type: ignore[arg-type]
    assert out.records == [] and out.lines == []


def test_a_worker_over_its_cap_is_named_once_by_the_rank_it_started_with():
    out = _Log()
    watch = CapWatch([100, 200, 300], out, out)  # type: ignore[arg-type]
    watch.after_round(_round(50, 250, None), [0, 1, 2])  # worker 1 over; worker 2 tells no peak
    watch.after_round(_round(260, 310), [1, 2])  # worker 0 left: places now hold bundles 1 and 2
    assert [(k, r["bundle"], r["peak_bytes"], r["cap_bytes"]) for k, r in out.records] == [
        ("memory_over_cap", 1, 250, 200),
        ("memory_over_cap", 2, 310, 300),
    ]
    assert len(out.lines) == 2 and "worker 1 peaked at" in out.lines[0] and "ScalingConfig.shard_slices" in out.lines[0]
