"""benchmarks/compare.py's synthetic workloads (the runners themselves run in tests/ray/test_balancing.py and in
the benchmarks): each builds its model and data, and one step of the loss backward works on them."""

from __future__ import annotations

import pytest
import torch

from benchmarks.compare import WORKLOADS, make_data, make_model, make_optimizer


@pytest.mark.parametrize("workload", [w for w in WORKLOADS if w != "newcomer"])  # newcomer: scikit-learn's digits
def test_each_synthetic_workload_trains_a_step_on_its_own_data(workload):
    torch.manual_seed(0)
    model = make_model(workload)
    x, y = make_data(workload)
    assert len(x) == len(y) == WORKLOADS[workload][0]
    opt = make_optimizer(model)
    loss = torch.nn.functional.cross_entropy(model(x[:8]), y[:8])
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)


def test_the_deep_workload_is_a_step_of_many_small_parameters():
    # launch-bound on a CPU, as a small model's step is on a GPU: many tensors, few elements each
    params = list(make_model("deep").parameters())
    assert len(params) == 50 and max(p.numel() for p in params) <= 256
