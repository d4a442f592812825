"""StepGate on a real card: a CUDA worker alone in its group gets the gate from the strategy's setup, skips a
non-finite step on the device and ends where one process deciding on the host ends (tests/unit/test_step_gate.py
checks the same on the CPU's fused kernels)."""

from __future__ import annotations

import pytest
import torch

from mixtrain.comm.strategy import AllReduceStrategy, JoinContext
from mixtrain.config import StrategyConfig
from mixtrain.records.messages import RoundPlan
from mixtrain.worker.ledger import RoundLedger
from tests.unit.test_step_gate import BAD_GRAD, BAD_LOSS, _assert_same, _backward, _reference, _task

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_a_cuda_worker_alone_skips_on_the_device_and_trains_like_one_process(one_rank_group):
    cuda = torch.device("cuda", 0)
    steps = 8
    ref, expected = _reference(steps, cuda)
    task = _task(cuda)
    strategy = AllReduceStrategy(StrategyConfig())
    ctx = JoinContext(bucket_bytes=1 << 20, loss_scaling=False, rank=0, world_size=1, timeout_s=10.0)
    strategy.setup(task, ctx)
    assert strategy.gate is not None  # chosen by itself on a card
    plan = RoundPlan(epoch=0, first_step=0, num_steps=steps, shares=(16,), global_batch=16, drift_tolerance=1.0)
    ledger = RoundLedger(0)
    for step in range(steps):
        strategy.zero_grad(task)
        loss = _backward(task, step)
        ledger.step_done(step, strategy.step(task, loss, 1.0), 0.01, 16, loss)
    report = ledger.close(plan, strategy.end_round(task, 1.0, 1.0), None, {})
    assert report.skipped_steps == [BAD_GRAD, BAD_LOSS] and [s for s in range(steps) if not expected[s]] == [
        BAD_GRAD,
        BAD_LOSS,
    ]
    assert len(report.grad_norms) == steps - 2
    _assert_same(task, ref)
