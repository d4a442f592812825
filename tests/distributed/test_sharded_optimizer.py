"""The sharded optimizer on real gloo ranks: each rank steps its slice and the slices are broadcast back;
the result is one AdamW over the whole model, an LR scheduler included, and each rank holds only its slice."""

import torch

from mixtrain.comm.zero import ShardedOptimizer, split_runs
from tests.distributed.ranks import run_ranks

STEPS = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    groups = [
        {"params": list(model[0].parameters()), "weight_decay": 0.1},
        {"params": list(model[2].parameters()) + list(model[3].parameters())},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _grads(model: torch.nn.Module, step: int) -> None:
    """Every rank holds the same summed gradient after the exchange: compute it the same way everywhere."""
    torch.manual_seed(100 + step)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _sharded(rank, world, weights):
    model = _model()
    opt, sched = _optimizer(model)
    sizes = [p.numel() for g in opt.param_groups for p in g["params"]]
    shard = ShardedOptimizer(opt, split_runs(sizes, weights), rank)
    for step in range(STEPS):
        _grads(model, step)
        shard.step()
        sched.step()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "bytes": shard.state_bytes(),
        "keys": sorted(shard.state_part()),
        "user_state": len(opt.state),
    }


def test_sharded_adamw_with_a_scheduler_equals_one_adamw_and_holds_only_its_slice():
    weights = [3, 1, 2]
    out = run_ranks(_sharded, 3, weights)
    assert all(status == "ok" for status, _ in out.values()), out
    model = _model()
    opt, sched = _optimizer(model)
    for step in range(STEPS):
        _grads(model, step)
        opt.step()
        sched.step()
    full_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    for rank in range(3):
        res = out[rank][1]
        for got, want in zip(res["weights"], model.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
        assert res["user_state"] == 0  # the user's optimizer only carries hyperparameters
    parts = [out[r][1]["keys"] for r in range(3)]
    assert sorted(k for p in parts for k in p) == list(range(len(list(model.parameters()))))
    assert sum(out[r][1]["bytes"] for r in range(3)) == full_bytes
    assert all(0 < out[r][1]["bytes"] < full_bytes for r in range(3))
