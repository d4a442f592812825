"""StepGate: a worker alone on a GPU skips a non-finite step on the device and reads the verdict one step late.
The gate runs only on CUDA in production (where the host's read is a wait); here it runs on the CPU, whose
fused Adam/AdamW/SGD take the same `found_inf`, so the bookkeeping and the math are checked without a GPU. The
GPU check's pytest-gpu and overhead steps run it on a card."""

from __future__ import annotations

import math

import pytest
import torch

from mixtrain.comm.step_gate import StepGate, as_user_built, can_gate
from mixtrain.comm.strategy import AllReduceStrategy, JoinContext, clip_gradients
from mixtrain.config import StrategyConfig
from mixtrain.records.messages import RoundPlan
from mixtrain.task import Task
from mixtrain.worker.ledger import RoundLedger

CPU = torch.device("cpu")
BAD_GRAD, BAD_LOSS = 3, 5  # the steps whose gradient, then loss, is not finite


def _task(device: torch.device = CPU) -> Task:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return Task(
        model=model,
        optimizer=optimizer,
        loss_fn=torch.nn.functional.cross_entropy,
        scheduler=scheduler,
        max_grad_norm=0.5,
    )


def _backward(task: Task, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    x, y = x.to(next(task.model.parameters()).device), y.to(next(task.model.parameters()).device)
    for p in task.model.parameters():
        p.grad = None
    loss = task.batch_loss(task.model, (x, y))
    loss.backward()
    if step == BAD_GRAD:
        next(task.model.parameters()).grad[0, 0] = float("nan")
    return (loss.detach() * (math.nan if step == BAD_LOSS else 1.0)).reshape(1)


def _reference(steps: int, device: torch.device = CPU) -> tuple[Task, list[bool]]:
    """One process deciding on the host: a non-finite step changes nothing, the scheduler included."""
    task = _task(device)
    verdicts = []
    for step in range(steps):
        loss = _backward(task, step)
        grads = [p.grad for p in task.model.parameters()]
        ok = bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
        verdicts.append(ok)
        if ok:
            clip_gradients(task, list(task.model.parameters()))
            task.optimizer.step()
            assert task.scheduler is not None
            task.scheduler.step()
    return task, verdicts


def _assert_same(a: Task, b: Task) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-8)
        assert float(sa["step"]) == float(sb["step"])
    assert a.scheduler is not None and b.scheduler is not None
    assert a.scheduler.last_epoch == b.scheduler.last_epoch
    assert a.optimizer.param_groups[0]["lr"] == pytest.approx(b.optimizer.param_groups[0]["lr"])


def test_a_gated_run_equals_the_host_verdict_and_skips_a_non_finite_step_on_the_device():
    steps = 8
    ref, expected = _reference(steps)
    assert expected.count(False) == 2
    task = _task()
    params = list(task.model.parameters())
    assert can_gate(task.optimizer, CPU)
    gate = StepGate(task.optimizer, CPU)
    verdicts: list[bool] = []
    norms = []
    for step in range(steps):
        loss = _backward(task, step)
        gate.step(task, [p.grad for p in params], loss, lambda: clip_gradients(task, params))
        for applied, _, norm in gate.drain():  # the step before's verdict, read now
            verdicts.append(applied)
            norms.append(norm)
        assert len(verdicts) == step  # always one step behind
    gate.settle(task)
    for applied, _, norm in gate.drain():
        verdicts.append(applied)
        norms.append(norm)
    assert verdicts == expected
    assert [n is None for n in norms] == [not v for v in expected]  # a skipped step reports no norm
    _assert_same(task, ref)
    assert all(g["fused"] for g in task.optimizer.param_groups)  # switched to the kernel that can skip


def test_checkpoints_keep_the_users_setting_and_a_load_that_brings_it_back_is_fused_again():
    task = _task()
    params = list(task.model.parameters())
    gate = StepGate(task.optimizer, CPU)
    for step in range(3):
        _backward(task, step)
        gate.step(task, [p.grad for p in params], torch.ones(1), lambda: None)
    gate.settle(task)
    assert [v[0] for v in gate.drain()] == [True] * 3
    saved = as_user_built(task.optimizer, task.optimizer.state_dict())
    assert all(g["fused"] is None for g in saved["param_groups"])  # as the user built it
    assert (
        StepGate(task.optimizer, CPU) is not None
        and as_user_built(task.optimizer, task.optimizer.state_dict())["param_groups"][0]["fused"] is None
    )  # a group that re-forms makes a new gate: still the user's setting
    plain = _task()  # a resume on a CPU worker: the for-each AdamW takes it as is
    plain.optimizer.load_state_dict(saved)
    assert not plain.optimizer.param_groups[0]["fused"]
    task.optimizer.load_state_dict(saved)  # a group re-formed: the user's settings are back...
    assert not task.optimizer.param_groups[0]["fused"]
    _backward(task, 4)
    gate.step(task, [p.grad for p in params], torch.ones(1), lambda: None)  # ...and the gate fuses again
    gate.settle(task)
    assert [v[0] for v in gate.drain()] == [True] and task.optimizer.param_groups[0]["fused"]
    assert float(task.optimizer.state[params[0]]["step"]) == 4


@pytest.mark.parametrize(
    "make, ok",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), True),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True), False),  # the user asked for for-each
        (lambda ps: torch.optim.RMSprop(ps, lr=0.1), False),  # no fused kernel that skips
        (lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps, lr=0.1), False),  # a subclass may change step
    ],
)
def test_only_optimizers_whose_fused_kernel_skips_are_gated(make, ok):
    model = torch.nn.Linear(3, 2)
    assert can_gate(make(model.parameters()), CPU) is ok
    assert not can_gate(torch.optim.AdamW(model.parameters()), torch.device("meta"))  # params elsewhere


def _strategy(task: Task) -> AllReduceStrategy:
    strategy = AllReduceStrategy(StrategyConfig())
    ctx = JoinContext(bucket_bytes=1 << 20, loss_scaling=False, rank=0, world_size=1, timeout_s=10.0)
    strategy.setup(task, ctx)
    assert strategy.gate is None  # on a CPU the host's verdict costs no wait: no gate
    strategy.gate = StepGate(task.optimizer, CPU)  # as on a CUDA device
    return strategy


def test_the_worker_ledger_gets_every_step_once_in_order_late_verdicts_included(one_rank_group):
    task = _task()
    strategy = _strategy(task)
    plan = RoundPlan(epoch=0, first_step=0, num_steps=BAD_GRAD + 2, shares=(16,), global_batch=16, drift_tolerance=1.0)
    ledger = RoundLedger(0)
    for step in range(plan.num_steps):
        strategy.zero_grad(task)
        loss = _backward(task, step)
        ledger.step_done(step, strategy.step(task, loss, 1.0), 0.01, 16, loss)
    report = ledger.close(plan, strategy.end_round(task, 1.0, 1.0), None, {})
    assert len(report.losses) == plan.num_steps and report.skipped_steps == [BAD_GRAD]
    assert len(report.grad_norms) == plan.num_steps - 1 and all(math.isfinite(n) for n in report.grad_norms)
    assert strategy.gate is not None and strategy.gate.pending is None
    assert strategy.optimizer_state(task)["param_groups"][0]["fused"] is None  # checkpoints: the user's setting


def test_a_round_stopped_part_way_counts_the_step_whose_verdict_was_still_to_be_read(one_rank_group):
    task = _task()
    strategy = _strategy(task)
    ledger = RoundLedger(0)
    for step in range(2):
        strategy.zero_grad(task)
        loss = _backward(task, step)
        ledger.step_done(step, strategy.step(task, loss, 1.0), 0.01, 16, loss)
    assert ledger.committed_steps == 1  # the second step is applied on the device, its verdict unread
    ledger.take_late(strategy.flush(task))  # what the worker does before reporting a failed round
    assert ledger.committed_steps == 2
    assert task.scheduler is not None and task.scheduler.last_epoch == 2
