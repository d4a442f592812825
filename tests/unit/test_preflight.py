"""Preflight: versions, model signature and devices compared across workers; numerics verdicts; backend."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mixtrain.comm.process_group import choose_backend, shared_gpu
from mixtrain.devices import DeviceInfo
from mixtrain.group import preflight
from mixtrain.records.messages import BuildReport, NumericsResult

DRIVER = {"python": "3.11.9", "torch": "2.13.0", "ray": "2.60.0", "mixtrain": "0.1.0", "numpy": "2.1"}


def device(name="CPU", kind="cpu"):
    return DeviceInfo(kind=kind, index=0, name=name, total_memory=None, free_memory=None, bf16=False, fp16=False)


def report(rank, host="10.0.0.1", signature="abc", **versions):
    return BuildReport(
        rank=rank, host=host, requested="cpu", versions={**DRIVER, **versions}, device=device(), signature=signature
    )


def test_matching_workers_pass_and_local_version_suffixes_are_the_same_release():
    preflight.check(DRIVER, [report(0), report(1, torch="2.13.0+cu128", python="3.11.4")])


def test_every_mismatch_is_named_with_node_and_value_in_one_error():
    missing = replace(
        report(2, host="10.0.0.3"),
        device=None,
        signature=None,
        problem="this worker asked for a cuda device but torch on its node reports none",
    )
    reports = [report(0), report(1, host="10.0.0.2", python="3.12.1", signature="zzz"), missing]
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(DRIVER, reports)
    text = str(err.value)
    assert "worker 1 on 10.0.0.2: python 3.12.1 but the driver has 3.11.9" in text
    assert "worker 1 on 10.0.0.2: its model differs from worker 0's: signature zzz instead of abc" in text
    assert "worker 2 on 10.0.0.3: this worker asked for a cuda device" in text
    assert "MISSING cpu" in text and "nothing was trained" in text
    header = [line for line in text.splitlines() if line.startswith("who")]
    assert header and "python" in header[0] and "model" in header[0]


def test_a_model_that_differs_is_named_down_to_the_tensor_and_both_shapes():
    ref = replace(report(0), tensors=(("fc.weight", (10, 64), "float32"), ("fc.bias", (10,), "float32")))
    other = replace(
        report(1, host="10.0.0.2", signature="zzz"),
        tensors=(("fc.weight", (10, 128), "float32"), ("fc.bias", (10,), "float32"), ("extra", (3,), "float32")),
    )
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(DRIVER, [ref, replace(report(2), tensors=ref.tensors), other])
    text = str(err.value)
    assert (
        "worker 1 on 10.0.0.2: its model differs from worker 0's: fc.weight is (10, 64) float32 on worker 0, "
        "(10, 128) float32 on worker 1; extra only on worker 1" in text
    ), text


def test_numerics_verdict_names_the_device():
    lines, bad = preflight.numerics_verdict(
        [NumericsResult(rank=0, error=0.0, tolerance=1e-3), NumericsResult(rank=1, error=0.3, tolerance=1e-3)],
        [report(0), replace(report(1), device=device("Apple M2 GPU (MPS)", "mps"))],
    )
    assert bad == [1]
    assert lines == [
        "worker 1 (Apple M2 GPU (MPS)): gradient differs from the CPU's by 3.00e-01 (relative L2; tolerance 1e-03)"
    ]


def test_a_nan_gradient_fails_the_numerics_check():
    # NaN compares false with everything: `error > tolerance` let a device with NaN gradients pass
    results = [NumericsResult(rank=r, error=e, tolerance=1e-3) for r, e in ((0, 0.0), (1, math.nan))]
    lines, bad = preflight.numerics_verdict(results, [report(0), report(1)])
    assert bad == [1] and "by nan" in lines[0], lines


def test_backend_follows_the_device_set():
    assert choose_backend("auto", ["cuda", "cuda"], True) == "nccl"
    assert choose_backend("auto", ["cuda", "mps"], True) == "gloo"
    assert choose_backend("auto", ["cuda", "cuda"], False) == "gloo"
    assert choose_backend("gloo", ["cuda", "cuda"], True) == "gloo"
    with pytest.raises(ValueError, match=r"backend='nccl' needs every worker on CUDA.*\['cuda', 'cpu'\]"):
        choose_backend("nccl", ["cuda", "cpu"], True)


def test_two_workers_on_one_gpu_never_get_nccl():
    """Found on a real H100 (the GPU check, 2026-11-24): NCCL refuses two ranks on one card ("Duplicate GPU
    detected"), which is what two workers at half a GPU each are. auto falls back to gloo; nccl is refused
    before any group forms, with the fix."""
    same_card = [("10.0.0.1", "cuda", "GPU-a"), ("10.0.0.1", "cuda", "GPU-a")]
    assert shared_gpu(same_card) == (0, 1)
    assert shared_gpu([("10.0.0.1", "cuda", "GPU-a"), ("10.0.0.1", "cuda", "GPU-b")]) is None
    assert shared_gpu([("10.0.0.1", "cuda", "GPU-a"), ("10.0.0.2", "cuda", "GPU-a")]) is None  # other node
    assert shared_gpu([("10.0.0.1", "cpu", ""), ("10.0.0.1", "cpu", "")]) is None
    assert shared_gpu([("h", "cuda", "x"), ("h", "cpu", ""), ("h", "cuda", "x")]) == (0, 2)
    assert choose_backend("auto", ["cuda", "cuda"], True, (0, 1)) == "gloo"
    with pytest.raises(ValueError, match=r"workers 0 and 1 share one GPU.*resources_per_worker=\{'GPU': 1\}"):
        choose_backend("nccl", ["cuda", "cuda"], True, (0, 1))


def test_a_cuda_device_reports_its_uuid(monkeypatch):
    from mixtrain.devices.cuda import CudaDevice

    class Props:
        uuid = "4600b3ca-1d6d-279f-16a3-e1ea56a93741"

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    assert CudaDevice().uuid(0) == "4600b3ca-1d6d-279f-16a3-e1ea56a93741"


def test_a_loop_run_chooses_its_backend_as_a_task_does_and_two_workers_on_one_gpu_get_gloo():
    """The loop's bring-up chose its backend with a copy that lost the fix above (issue 45 item 7): two CUDA workers
    on one card got NCCL. Both doors now call group_backend."""
    from mixtrain.comm.process_group import group_backend
    from mixtrain.records.messages import LoopDevice, WorkerInfo
    from mixtrain.train._trainer import loop_backend

    def loop_worker(rank, uuid, nccl=True):
        info = WorkerInfo(
            rank=rank, host="10.0.0.1", hostname="h", pid=rank, node_id="n", device=f"cuda:{rank}",
            device_name="H100", precision="fp32", threads=1,
        )  # fmt: skip
        return LoopDevice(info=info, uuid=uuid, nccl=nccl)

    shared = [loop_worker(0, "GPU-a"), loop_worker(1, "GPU-a")]
    assert loop_backend("auto", shared) == ("gloo", "backend gloo, not NCCL: workers 0 and 1 share one GPU")
    assert loop_backend("auto", [loop_worker(0, "GPU-a"), loop_worker(1, "GPU-b")]) == ("nccl", None)
    assert loop_backend("auto", [loop_worker(0, "GPU-a"), loop_worker(1, "GPU-b", nccl=False)])[0] == "gloo"
    with pytest.raises(ValueError, match="share one GPU"):
        loop_backend("nccl", shared)
    task = [("10.0.0.1", "cuda", "GPU-a", True), ("10.0.0.1", "cuda", "GPU-a", True)]  # a Task's build reports
    assert group_backend("auto", task) == loop_backend("auto", shared)
