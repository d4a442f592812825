"""Real multi-process gloo collectives on 127.0.0.1: buckets, finiteness agreement, replicas, rendezvous."""

import time

import pytest
import torch

from mixtrain.comm import replicas
from mixtrain.comm.buckets import GradBuckets
from tests.distributed.ranks import run_ranks


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _weighted_grads(rank, world, shares, poison):
    model = _model(0)
    buckets = GradBuckets(list(model.parameters()), bucket_bytes=64, num_extras=1)  # tiny: several buckets
    torch.manual_seed(100)
    x, y = torch.randn(sum(shares), 6), torch.randint(0, 3, (sum(shares),))
    lo = sum(shares[:rank])
    xs, ys = x[lo : lo + shares[rank]], y[lo : lo + shares[rank]]
    buckets.zero_()
    loss = torch.zeros(())
    if shares[rank]:  # a rank with no samples runs no backward: its buckets start in all_reduce_
        loss = torch.nn.functional.cross_entropy(model(xs), ys) * (shares[rank] / sum(shares))
        loss.backward()
    if poison == rank:
        next(model.parameters()).grad[0, 0] = float("inf")
    summed = buckets.all_reduce_(torch.tensor([loss.item()]))
    return {
        "grads": [p.grad.clone() for p in model.parameters()],
        "loss": float(summed[0]),
        "finite": buckets.all_finite(),
        "num_buckets": len(buckets.buckets),
    }


@pytest.mark.parametrize("shares", [[7, 2, 3], [7, 0, 5]])
def test_unequal_shares_sum_to_the_global_mean_gradient(shares):
    out = run_ranks(_weighted_grads, 3, shares, -1)
    assert all(status == "ok" for status, _ in out.values()), out
    model = _model(0)
    torch.manual_seed(100)
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for rank in range(3):
        res = out[rank][1]
        assert res["num_buckets"] > 1
        assert abs(res["loss"] - loss.item()) < 1e-6
        for got, p in zip(res["grads"], model.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=1e-7)
    # identical bits on every rank
    for g0, g1 in zip(out[0][1]["grads"], out[2][1]["grads"]):
        assert torch.equal(g0, g1)


def test_one_rank_with_inf_makes_every_rank_skip():
    out = run_ranks(_weighted_grads, 2, [3, 3], 1)
    assert [out[r][1]["finite"] for r in (0, 1)] == [False, False]


def _drift_and_buffers(rank, world, perturb):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank != 0:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))  # other init
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replicas.broadcast_state(model, opt)
    synced = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank + 1))
        if rank == 1:
            model[0].weight[0, 0] += perturb
    replicas.average_buffers(model, weight=[0.75, 0.25][rank])
    d, rebroadcast = replicas.resync_if_drifted(model, opt, tolerance=1e-6)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "synced": synced,
        "running_mean": model[1].running_mean.clone(),
        "drift": d,
        "rebroadcast": rebroadcast,
    }


def test_broadcast_weighted_buffers_and_drift_rebroadcast():
    out = run_ranks(_drift_and_buffers, 2, 1e-3)
    r0, r1 = out[0][1], out[1][1]
    for a, b in zip(r0["synced"], r1["synced"]):
        assert torch.equal(a, b)  # initial broadcast made the replicas identical
    # running_mean: 0.75 * 1 + 0.25 * 2
    assert torch.allclose(r1["running_mean"], torch.full((4,), 1.25, dtype=r1["running_mean"].dtype))
    assert r0["rebroadcast"] and r1["rebroadcast"] and r1["drift"] > 1e-6
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_no_rebroadcast_without_drift():
    out = run_ranks(_drift_and_buffers, 2, 0.0)
    assert out[1][1]["drift"] == 0.0 and not out[1][1]["rebroadcast"]


def _broadcast_counting(rank, world, differ):
    """Replicas from one seed; `differ`: rank 1 changes one value's bits (0.0 to -0.0, or one ulp). Counts what
    broadcast_state sent (the real collectives run; the count is read around them)."""
    sent = []
    real = replicas._flat_broadcast
    replicas._flat_broadcast = lambda tensors, src=0: (sent.append(len(tensors)), real(tensors, src))
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # momentum buffers: optimizer state goes too
    with torch.no_grad():
        bias = model[2].bias
        if rank == 1 and differ == "sign":
            bias.zero_()
        elif rank == 1 and differ == "ulp":
            bias[0] = torch.nextafter(bias[0], torch.tensor(1e9))
        elif differ == "sign":
            bias.zero_().neg_()  # -0.0 on rank 0: equal as numbers, not as bytes
    replicas.broadcast_state(model, opt)
    state = [t.clone() for t in [*model.parameters(), *replicas.optimizer_tensors(opt)]]
    return {"sent": sent, "state": state, "digest": replicas.digest(state)}


@pytest.mark.parametrize("differ", [None, "sign", "ulp"])
def test_broadcast_sends_nothing_where_every_replica_holds_rank_0s_bytes(differ):
    out = run_ranks(_broadcast_counting, 2, differ)
    assert all(status == "ok" for status, _ in out.values()), out
    r0, r1 = out[0][1], out[1][1]
    assert r0["sent"] == r1["sent"] == ([] if differ is None else [8])  # 4 weights and biases, 4 momenta
    for a, b in zip(r0["state"], r1["state"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert r0["digest"] == r1["digest"]


def _measure_both_ways(rank, world):
    from mixtrain.comm import link_measure

    buf = torch.zeros(2**20)  # 4 MiB
    calls = []

    def exchange():
        calls.append(1)
        torch.distributed.all_reduce(buf)

    timed = link_measure.exchange_seconds(exchange, link_measure.all_reduce_probe, 4 * buf.numel(), 3)
    link_measure.MEASURE_BUDGET_S = 1e-6  # any exchange is "slow" now: the probes and the line through them
    line = link_measure.exchange_seconds(exchange, link_measure.all_reduce_probe, 4 * buf.numel(), 3)
    gathered = link_measure.exchange_seconds(lambda: None, link_measure.all_gather_probe, 4 * buf.numel(), 3)
    return {"timed": timed, "calls": len(calls), "line": line, "gathered": gathered}


def test_the_link_measurement_runs_alike_on_every_rank_timed_or_extrapolated():
    """The decisions follow shared times, so no rank waits in a collective the other never calls (a hang
    would be the failure); on loopback 4 MiB is quick: timed itself, then, with the budget at nothing, from
    the probes alone."""
    out = run_ranks(_measure_both_ways, 2)
    assert all(status == "ok" for status, _ in out.values()), out
    for rank in (0, 1):
        res = out[rank][1]
        assert res["calls"] >= 2  # a warm-up and at least one timed call; none in the extrapolated runs
        assert 0 < res["timed"] < 5 and 0 < res["line"] < 5 and 0 < res["gathered"] < 5
    assert out[0][1]["calls"] == out[1][1]["calls"]


def _noop(rank, world):
    return rank


def test_missing_peer_is_a_clear_error_not_a_hang():
    t0 = time.monotonic()
    out = run_ranks(_noop, 2, timeout_s=2.0, ranks=[0])  # rank 1 never starts
    assert time.monotonic() - t0 < 30
    status, message = out[0]
    assert status == "error"
    assert "RendezvousError" in message and "MIXTRAIN_RENDEZVOUS_TIMEOUT_S" in message


def _loss_scaled_steps(rank, world, scaling):
    from mixtrain.comm.strategy import AllReduceStrategy, JoinContext
    from mixtrain.config import StrategyConfig
    from mixtrain.task import Task

    model = _model(0)
    task = Task(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), loss_fn=torch.nn.functional.cross_entropy
    )
    strategy = AllReduceStrategy(StrategyConfig())
    strategy.setup(task, JoinContext(bucket_bytes=64, loss_scaling=scaling, rank=rank, world_size=world, timeout_s=30))
    torch.manual_seed(100)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    scales, applied = [], []
    for step in range(2):
        strategy.zero_grad(task)
        xs, ys = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
        loss = task.loss_fn(model(xs), ys)
        strategy.before_last_backward(task)
        (loss * (0.5 * strategy.loss_scale.scale)).backward()
        if step == 1 and rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")  # overflow on one rank only
        scales.append(strategy.loss_scale.scale)
        applied.append(strategy.step(task, torch.tensor([float(loss) * 0.5]), 0.5).done[0].applied)
    scales.append(strategy.loss_scale.scale)
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales, "applied": applied}


def test_one_loss_scale_for_the_job_unscales_exactly_and_halves_on_every_rank_after_an_overflow():
    scaled = run_ranks(_loss_scaled_steps, 2, True)
    plain = run_ranks(_loss_scaled_steps, 2, False)
    assert all(s == "ok" for s, _ in (*scaled.values(), *plain.values())), (scaled, plain)
    for rank in (0, 1):
        assert scaled[rank][1]["scales"] == [65536.0, 65536.0, 32768.0]
        assert scaled[rank][1]["applied"] == [True, False]
        for a, b in zip(scaled[rank][1]["params"], plain[0][1]["params"]):
            assert torch.equal(a, b)  # a power-of-two scale and unscale change no bit
