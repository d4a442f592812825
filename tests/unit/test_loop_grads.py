"""The prepared model's gradient weighting, in one process (a gloo group of one, whose sum is the identity): each
backward's gradient is weighted by its batch's share, through no_sync() accumulation and empty batches too
(issue 35). The multi-worker sums are tested on real Ray workers in tests/ray/test_loops.py."""

from __future__ import annotations

import torch
from torch import nn

from mixtrain.comm.loop_grads import LoopGrads


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _plain_grad(model, x, y, weight):
    model.zero_grad(set_to_none=True)
    (nn.functional.cross_entropy(model(x), y) * weight).backward()
    return _grads(model)


def test_a_synchronised_backward_weights_the_gradient_by_its_share(one_rank_group):
    model, plain = _model(), _model()
    grads = LoopGrads([p for p in model.parameters()], 1 << 20, torch.device("cpu"))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    for weight in (0.25, 1.0, 0.6):  # zero_grad(set_to_none) between steps, as loops do
        model.zero_grad(set_to_none=True)
        grads.before_forward(weight, sync=True)
        nn.functional.cross_entropy(model(x), y).backward()
        for got, want in zip(_grads(model), _plain_grad(plain, x, y, weight)):
            assert torch.allclose(got, want, atol=1e-7)
    assert grads.comm_s > 0


def test_no_sync_accumulation_weights_each_backward_by_its_own_share(one_rank_group):
    model, plain = _model(), _model()
    grads = LoopGrads([p for p in model.parameters()], 64, torch.device("cpu"))  # several small buckets
    parts = [(torch.randn(3, 4), torch.randint(0, 2, (3,)), w) for w in (0.5, 0.2, 0.3)]
    model.zero_grad(set_to_none=True)
    for i, (x, y, w) in enumerate(parts):
        grads.before_forward(w, sync=i == len(parts) - 1)  # the last one outside no_sync: the sum
        nn.functional.cross_entropy(model(x), y).backward()
    want = [torch.zeros_like(p) for p in plain.parameters()]
    for x, y, w in parts:
        want = [a + b for a, b in zip(want, _plain_grad(plain, x, y, w))]
    for got, expected in zip(_grads(model), want):
        assert torch.allclose(got, expected, atol=1e-6)


def test_an_empty_batch_counts_for_nothing_even_within_an_accumulation(one_rank_group):
    model, plain = _model(), _model()
    grads = LoopGrads([p for p in model.parameters()], 1 << 20, torch.device("cpu"))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    model.zero_grad(set_to_none=True)
    grads.before_forward(0.7, sync=False)
    nn.functional.cross_entropy(model(x), y).backward()
    grads.before_forward(0.0, sync=True)  # a batch of no samples: its mean loss is NaN
    nn.functional.cross_entropy(model(x[:0]), y[:0]).backward()
    for got, want in zip(_grads(model), _plain_grad(plain, x, y, 0.7)):
        assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-7)
