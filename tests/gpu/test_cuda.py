"""CUDA tests: run on a machine with an NVIDIA GPU, skipped elsewhere (never faked).

A CUDA rank and a CPU rank in one gloo group (CUDA gradients staged through CPU buffers)
must train exactly like one process; the CUDA device class must describe the real card.
These need no Ray, so they also run on a GPU machine that has only torch."""

from __future__ import annotations

import pytest
import torch

from mixtrain import devices
from mixtrain.comm.strategy import AllReduceStrategy, JoinContext
from mixtrain.config import StrategyConfig
from mixtrain.task import Task
from tests.distributed.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

SHARES = [40, 24]
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * sum(SHARES), 20, generator=g), torch.randint(0, 5, (STEPS * sum(SHARES),), generator=g)


def _mixed_rank(rank, world):
    device = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    model = _model().to(device)
    task = Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        loss_fn=torch.nn.functional.cross_entropy,
    )
    strategy = AllReduceStrategy(StrategyConfig())
    strategy.setup(task, JoinContext(bucket_bytes=2048, loss_scaling=False, rank=rank, world_size=world, timeout_s=60))
    x, y = _data()
    b = sum(SHARES)
    for step in range(STEPS):
        lo = step * b + sum(SHARES[:rank])
        xs, ys = x[lo : lo + SHARES[rank]].to(device), y[lo : lo + SHARES[rank]].to(device)
        strategy.zero_grad(task)
        strategy.before_last_backward(task)
        loss = task.loss_fn(model(xs), ys)
        (loss * (SHARES[rank] / b)).backward()
        strategy.step(task, torch.tensor([float(loss) * SHARES[rank] / b]), SHARES[rank] / b)
    return {"device": str(device), "params": [p.detach().cpu() for p in model.parameters()]}


def test_a_cuda_rank_and_a_cpu_rank_train_like_one_process():
    out = run_ranks(_mixed_rank, 2, timeout_s=120)
    assert all(status == "ok" for status, _ in out.values()), out
    assert out[0][1]["device"] == "cuda:0" and out[1][1]["device"] == "cpu"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _data()
    b = sum(SHARES)
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[step * b : (step + 1) * b]), y[step * b : (step + 1) * b]).backward()
        opt.step()
    for rank in (0, 1):
        for got, want in zip(out[rank][1]["params"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


def test_the_cuda_device_class_describes_the_real_card():
    info = devices.get("cuda").info(0)
    assert info.kind == "cuda" and info.name == torch.cuda.get_device_name(0)
    assert info.total_memory and info.free_memory and 0 < info.free_memory <= info.total_memory
    assert info.bf16 == (torch.cuda.get_device_capability(0)[0] >= 8)
    assert devices.resolve("gpu").kind == "cuda"
    assert devices.get("cuda").is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))


def test_the_memory_probe_survives_a_real_out_of_memory_on_the_card():
    """A batch that cannot fit raises the card's real OutOfMemoryError; the search catches it,
    frees the cache and settles on a batch that does fit, and the card stays usable."""
    from mixtrain.worker.probe import largest_fitting

    kind = devices.get("cuda")
    total, _ = kind.memory(0)
    assert total is not None
    per_sample = 256 * 2**20  # each sample allocates 256 MiB of activations
    limit = int(total // per_sample) * 4  # far past what the card holds

    def run(batch: int) -> None:
        x = torch.empty(batch, per_sample // 4, device="cuda")  # float32: 4 bytes each
        x.fill_(1.0)
        torch.cuda.synchronize()

    def free() -> None:
        torch.cuda.empty_cache()

    found = largest_fitting(run, 8, limit, kind.is_oom, after_oom=free)
    assert 0 < found * per_sample <= total
    assert found * per_sample > 0.5 * total  # within the bisection's margin of the real capacity
    run(found)  # the card still works after the out-of-memory errors
