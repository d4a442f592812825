"""Pure parts of the strategies: wire encoding, the parameter split, the strategy advice, the config checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixtrain.comm.compress import decode, encode
from mixtrain.comm.ps_server import num_shards, partition
from mixtrain.config import LocalSGDConfig, StrategyConfig
from mixtrain.policies.advice import suggest


@pytest.mark.parametrize("compress,itemsize,tol", [("none", 4, 0.0), ("bf16", 2, 2**-8), ("fp16", 2, 2**-11)])
def test_wire_encoding_round_trips_at_its_precision(compress, itemsize, tol):
    t = torch.randn(1000) * 3
    wire = encode(t, compress)
    assert isinstance(wire, np.ndarray) and wire.itemsize == itemsize and wire.size == 1000
    back = decode(wire, compress)
    assert back.dtype == torch.float32
    assert float(((back - t).abs() / t.abs().clamp_min(1e-6)).max()) <= tol


def test_bf16_keeps_fp32_range_where_fp16_overflows():
    t = torch.tensor([1e6, 1e-20])
    assert torch.isfinite(decode(encode(t, "bf16"), "bf16")).all()
    assert not torch.isfinite(decode(encode(t, "fp16"), "fp16")).all()


def test_partition_balances_by_size_deterministically_and_covers_every_parameter():
    sizes = [1000, 10, 500, 500, 20, 990]
    parts = partition(sizes, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(sizes[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 20
    assert partition(sizes, 2) == parts and all(p == sorted(p) for p in parts)
    assert partition([5], 3) == [[0], [], []]


def test_auto_shards_follow_model_size():
    assert num_shards("auto", 1000) == 1
    assert num_shards("auto", 40 * 2**20) == 3
    assert num_shards("auto", 10**10) == 4
    assert num_shards(2, 10) == 2


def test_advice_keeps_allreduce_on_a_fast_link():
    line = suggest(0.050, 0.005, 2**20, StrategyConfig(), workers=2)
    assert "allreduce suggested" in line and "1.0 MB per exchange took 5.0 ms (200 MB/s)" in line


def test_advice_suggests_overlapped_local_sgd_with_enough_local_steps_on_a_slow_link():
    # 400 MB per step over 50 MB/s: 8 s of communication against 1 s of compute. Overlapped, an exchange runs
    # behind the next H steps and only a round's last (one in 4) blocks: H >= 8 / (0.1 x 4) = 20 -> 32
    line = suggest(1.0, 8.0, 400 * 2**20, StrategyConfig(), workers=2)
    assert "overlapped local-sgd with H=32 suggested (--strategy local-sgd --local-steps 32 --overlap)" in line
    assert "400.0 MB per exchange" in line and "(50 MB/s)" in line
    assert "H=64 suggested" in suggest(1.0, 16.0, 400 * 2**20, StrategyConfig(), workers=2)  # 40 -> 64
    # 64 s against 1 s: H=160 past the cap of 64; int8 deltas (a quarter of the bytes, scales included): 40.6
    line = suggest(1.0, 64.0, 400 * 2**20, StrategyConfig(), workers=2)
    assert "H=64 and int8 deltas suggested (--strategy local-sgd --local-steps 64 --overlap --compress int8)" in line
    assert "H=64 and int4 deltas" in suggest(1.0, 200.0, 400 * 2**20, StrategyConfig(), workers=2)
    line = suggest(1.0, 0.8, 400 * 2**20, StrategyConfig(), workers=2)  # the exchange hides behind 2 steps
    assert "local-sgd with H=2 suggested" in line and "--compress bf16 halves the bytes" in line
    line = suggest(0.1, 0.3, 2**20, StrategyConfig(compress="bf16"), workers=3)
    assert "H=8" in line and "--compress" not in line  # 3 / 0.4 = 7.5 -> the next power of two
    assert "allreduce suggested" in suggest(0.1, 0.05, 2**20, StrategyConfig(), workers=2)  # at most half
    assert "nothing to exchange" in suggest(0.1, 0.0, 0, StrategyConfig(), workers=1)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"name": "gossip"}, "strategy='gossip': use one of allreduce, ps, ps-async, local-sgd"),
        ({"compress": "int2"}, "StrategyConfig.compress='int2': use one of none, bf16, fp16, int8, int4"),
        ({"compress": "int8"}, "StrategyConfig.compress='int8' (--compress int8) works with strategy local-sgd only"),
        ({"name": "ps", "compress": "int4"}, "not 'ps': use compress='bf16' or 'fp16' here (--compress bf16)"),
        ({"local_sgd": LocalSGDConfig(overlap=True)}, "StrategyConfig.local_sgd.overlap=True (--overlap) works with"),
        (
            {"local_sgd": LocalSGDConfig(pace="per-device")},
            "(--pace per-device) works with strategy local-sgd (or auto",
        ),
    ],
)
def test_bad_strategy_settings_name_the_field_and_the_fix(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        StrategyConfig(**kwargs)
    assert fragment in str(err.value)


def test_auto_adopts_allreduce_on_a_fast_link_and_local_sgd_with_h_and_compression_on_a_slow_one():
    from mixtrain.policies.advice import choose

    auto, mb = StrategyConfig(name="auto"), 2**20
    assert choose(0.050, 0.005, auto, 2, mb).name == "allreduce"  # a tenth of the compute
    assert choose(0.1, 0.05, StrategyConfig(name="auto", compress="bf16"), 2, mb).compress == "bf16"
    assert choose(1.0, 8.0, auto, 1, mb).name == "allreduce"  # one worker: nothing to exchange
    slow = choose(0.1, 0.2, auto, 2, mb)  # twice the compute, overlapped: H = 2 / (0.1 x 4) = 5 -> 8
    assert (slow.name, slow.local_sgd.local_steps, slow.compress, slow.local_sgd.overlap) == (
        "local-sgd",
        8,
        "none",
        True,
    )
    slower = choose(1.0, 32.0, auto, 3, 400 * mb)  # H=80 past the cap: int8, H=32
    assert (slower.name, slower.local_sgd.local_steps, slower.compress, slower.local_sgd.overlap) == (
        "local-sgd",
        32,
        "int8",
        True,
    )
    assert (
        slower.local_sgd.outer_lr == auto.local_sgd.outer_lr
        and slower.local_sgd.outer_momentum == auto.local_sgd.outer_momentum
    )
    tiny = choose(0.0003, 0.004, auto, 2, 3_000)  # 3 KB: latency, which fewer bytes would not shorten
    assert (tiny.name, tiny.local_sgd.local_steps, tiny.compress) == ("local-sgd", 64, "none")


def test_auto_picks_a_narrower_wire_when_short_rounds_would_block_too_long():
    # The chars benchmark at 100 Mbit/s (measured): 24.3 MB of fp32 deltas take 2.2 s against 0.133 s of compute
    # per step, 105 steps an epoch. fp32 wants H=64 (16.5 x 2.5 = 41 -> 64), whose rounds of four exchanges the
    # epoch cuts to 105 steps: the epoch-end exchange waits 2.2 s of 14 (16%). int8 (a quarter) at the same H
    # waits 0.55 s (4%): int8, H=64 (its own H, 16, would make four times the exchanges)
    from mixtrain.policies.advice import choose, suggest

    auto, mb = StrategyConfig(name="auto"), 2**20
    unbounded = choose(0.133, 2.2, auto, 2, 24 * mb)
    assert (unbounded.local_sgd.local_steps, unbounded.compress) == (64, "none")  # rounds as long as they like
    epoch = choose(0.133, 2.2, auto, 2, 24 * mb, round_limit=105)
    assert (epoch.name, epoch.local_sgd.local_steps, epoch.compress, epoch.local_sgd.overlap) == (
        "local-sgd",
        64,
        "int8",
        True,
    )
    # 20 Mbit/s (measured 12.5 s): past the cap in fp32, int8 at H=64 would still wait 23% of an epoch, int4
    # 12%: the narrowest there is, at the H the wider wire needed
    slow = choose(0.13, 12.5, auto, 2, 24 * mb, round_limit=105)
    assert (slow.local_sgd.local_steps, slow.compress) == (64, "int4")
    # a wire that fits on its own keeps its own H: 1 Gbit/s (0.214 s against 0.13: 1.6 x 2.5 -> 8) fp32 at H=8
    fast = choose(0.13, 0.214, auto, 2, 24 * mb, round_limit=105)
    assert (fast.local_sgd.local_steps, fast.compress) == (8, "none")
    # evaluations every 200 steps of a long epoch cut rounds the same way (the bring-up passes the fewer)
    assert choose(0.133, 2.2, auto, 2, 24 * mb, round_limit=200).compress == "none"  # 2.2 / 200 x 0.133: 8%
    line = suggest(0.133, 2.2, 24 * mb, StrategyConfig(), 2, round_limit=105)
    assert "H=64 and int8 deltas suggested" in line
    tiny = choose(0.0003, 0.004, auto, 2, 3_000, round_limit=10)  # 3 KB: no wire makes latency shorter
    assert (tiny.local_sgd.local_steps, tiny.compress) == (64, "none")


def test_overlap_local_steps_is_the_h_choose_gives_for_that_wire():
    """The slow-link benchmark's rows at "the advisor's H" take it from here: the same H `choose` adopts."""
    from mixtrain.policies.advice import choose, overlap_local_steps

    assert overlap_local_steps(0.1, 0.2) == 8  # 2 / (0.1 x 4) = 5 -> 8, as choose above
    assert overlap_local_steps(1.0, 8.0) == 32 and overlap_local_steps(1.0, 0.01) == 2  # at least 2
    assert overlap_local_steps(0.1, 100.0) == 64  # at most MAX_LOCAL_STEPS
    for compute_s, exchange_s in ((0.13, 0.42), (0.13, 2.2), (1.0, 8.0)):
        picked = choose(compute_s, exchange_s, StrategyConfig(name="auto"), 2, 2**20)
        assert picked.local_sgd.local_steps == overlap_local_steps(compute_s, exchange_s)


def test_one_rank_keeps_plain_gradients_and_agrees_on_finiteness():
    """SoloGrads (one worker): autograd's own gradients, no bucket views; NaN/Inf anywhere (a gradient or the
    loss) is caught, a norm that merely overflows is not mistaken for one, and the loss scale unscales."""
    from mixtrain.comm.buckets import SoloGrads, make_grad_buckets

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    grads = make_grad_buckets(params, 1 << 20, num_extras=1)  # no process group: one rank
    assert isinstance(grads, SoloGrads) and grads.wire_bytes == 0
    grads.zero_()
    assert all(p.grad is None for p in params)
    model(torch.randn(5, 4)).sum().backward()
    loss = torch.tensor([0.5])
    assert grads.all_reduce_(loss) is loss and grads.all_finite(loss)
    before = [p.grad.clone() for p in params]
    grads.scale_(0.25)
    assert all(torch.equal(p.grad, b * 0.25) for p, b in zip(params, before))
    assert not grads.all_finite(torch.tensor([float("nan")]))
    params[1].grad[0] = float("inf")
    assert not grads.all_finite(loss)
    params[1].grad[0] = 3e38  # finite, but the norm of such values overflows: the elementwise check decides
    params[0].grad.fill_(3e38)
    assert grads.all_finite(loss)
    params[3].grad = None  # an unused parameter gets zeros, as in a group of several (a zeroed bucket view)
    grads.all_reduce_(loss)
    assert torch.equal(params[3].grad, torch.zeros_like(params[3])) and grads.all_finite(loss)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-check", "norms"])
def test_local_sgd_checks_finiteness_in_one_call_or_one_norm_and_elementwise_only_when_that_is_not_finite(
    monkeypatch, fused
):
    """The inner step ran an elementwise isfinite over every gradient each step (40 ms a step for the 6.4M
    slow-link model on this CPU, 9% of the worker's main thread); now, on a CPU or a CUDA device, torch's fused
    check (elementwise, no mask, one call), elsewhere (MPS: FUSED_CHECK without it) one norm, and the elementwise
    check only where that norm is not finite."""
    from types import SimpleNamespace

    from mixtrain import devices
    from mixtrain.comm import buckets
    from mixtrain.comm.local_sgd import LocalSGDStrategy
    from mixtrain.devices.precision import LossScale

    if not fused:
        monkeypatch.setattr(buckets, "FUSED_CHECK", ())
    model = torch.nn.Linear(4, 3)
    task = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=None)
    strategy = SimpleNamespace(params=list(model.parameters()), loss_scale=LossScale(enabled=False))
    elementwise = []
    real = devices.all_finite
    monkeypatch.setattr(devices, "all_finite", lambda ts: elementwise.append(1) or real(ts))
    for grad, loss, finite, checked in (
        (1.0, 0.5, True, 0),
        (1e38, 0.5, True, 0 if fused else 1),  # finite values whose norm overflows
        (float("nan"), 0.5, False, 0 if fused else 1),
        (1.0, float("inf"), False, 0 if fused else 1),  # the loss is checked too
    ):
        elementwise.clear()
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        before = [p.grad.clone() for p in model.parameters()]
        ok, _ = LocalSGDStrategy._optimizer_step(strategy, task, 1.0, also=(torch.tensor([loss]),))
        assert (ok, len(elementwise)) == (finite, checked)
        if not finite:  # the check changes nothing it reads (the fused one multiplies by 1)
            for p, b in zip(model.parameters(), before):
                torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)


def test_the_finite_check_takes_what_the_fused_call_does_not_by_norms():
    """An expanded view set by hand as a gradient (the fused call cannot write it in place), an integer extra: the
    fused call refuses them, and the verdict comes from norms (and the elementwise check), the same."""
    from mixtrain.comm.buckets import grads_finite

    dense = torch.ones(3)
    assert grads_finite([dense, torch.ones(1).expand(4)]) and grads_finite([torch.full((1,), 1e38).expand(4)])
    assert not grads_finite([dense, torch.full((1,), float("inf")).expand(4)])
    assert grads_finite([dense], torch.tensor([3])) and grads_finite([])
    assert not grads_finite([], torch.tensor([-torch.inf]))
