"""Local SGD's math, plain and overlapped (the exchange in the background, applied one exchange late),
against a one-process simulation of the same algorithm: the replicas, their windows of H inner steps, the
weighted deltas, the outer Nesterov step. Real Ray actors and gloo on the product side."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from mixtrain import LocalSGDConfig, RunConfig, ScalingConfig, StrategyConfig, Trainer
from mixtrain.data.sampling import epoch_permutation, steps_per_epoch
from tests.conftest import run_records
from tests.models import data, factory, faulty_task, make_task
from tests.ray.test_exactness import GLOBAL_BATCH, SEED, assert_same_weights, train

pytestmark = pytest.mark.usefixtures("ray_session")

NUM_SAMPLES = GLOBAL_BATCH * 32  # full batches only: every step's weights are the shares
H, ROUND = 2, 8  # four exchanges a round
OUTER_LR, MU = 0.7, 0.9


class Simulation:
    """Local SGD in one process, as documented in mixtrain.comm.local_sgd: every replica steps plain SGD on
    the mean gradient of its own slice; every H steps the share-weighted deltas from each replica's base are
    summed and applied to the common point A by SGD with Nesterov momentum. Plain: every replica then takes
    A. Overlapped: the sum is applied at the next exchange, and each replica becomes the new A minus its own
    delta; a round's end applies what is in flight and every replica takes A. Per-device pace: a replica
    steps on each `inner` samples of its slices in order, whatever the step they came in, and on what is left
    when an exchange comes."""

    def __init__(
        self, shares: list[int], overlap: bool, inner: int | None = None, outer: tuple[float, float] = (OUTER_LR, MU)
    ):
        torch.manual_seed(SEED)
        self.outer_lr, self.mu = outer
        self.task = make_task("mlp", "sgd0")
        self.shares, self.overlap, self.inner = shares, overlap, inner
        self.queues = [torch.zeros(0, dtype=torch.long) for _ in shares]  # per-device pace: not yet stepped on
        self.models = [copy.deepcopy(self.task.model) for _ in shares]
        self.opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in self.models]
        self.anchor = parameters_to_vector(self.task.model.parameters()).detach().clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.bases = [self.anchor.clone() for _ in shares]
        self.inflight: torch.Tensor | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, exchange_follows: bool) -> None:
        lo = 0
        for r, (m, opt, b) in enumerate(zip(self.models, self.opts, self.shares)):
            part = idx[lo : lo + b]
            lo += b
            if self.inner is None:
                self._sgd(m, opt, x[part], y[part])
                continue
            queue = torch.cat([self.queues[r], part])
            while len(queue) >= self.inner or (exchange_follows and len(queue)):
                batch, queue = queue[: self.inner], queue[self.inner :]
                self._sgd(m, opt, x[batch], y[batch])
            self.queues[r] = queue

    def _sgd(self, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        self.task.loss_fn(model(x), y).backward()
        opt.step()

    def _outer(self, delta: torch.Tensor) -> None:
        self.momentum.mul_(self.mu).add_(delta)
        self.anchor.sub_(delta.add_(self.momentum, alpha=self.mu), alpha=self.outer_lr)

    def _weighted_sum(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros_like(self.anchor)
        for d, b in zip(deltas, self.shares):
            out += d * (b / GLOBAL_BATCH)
        return out

    def _set(self, vectors: list[torch.Tensor]) -> None:
        self.bases = [v.clone() for v in vectors]
        for m, v in zip(self.models, vectors):
            vector_to_parameters(v.clone(), m.parameters())  # the parameters become views of what it is given

    def exchange(self) -> None:
        deltas = [base - parameters_to_vector(m.parameters()).detach() for base, m in zip(self.bases, self.models)]
        if not self.overlap:
            self._outer(self._weighted_sum(deltas))
            self._set([self.anchor] * len(self.models))
            return
        if self.inflight is None:  # the weights are A - d already
            self.bases = [self.anchor - d for d in deltas]
        else:
            self._outer(self.inflight)
            self._set([self.anchor - d for d in deltas])
        self.inflight = self._weighted_sum(deltas)

    def end_round(self) -> None:
        if self.inflight is not None:  # rounds are whole windows here: nothing is left to exchange
            self._outer(self.inflight)
            self.inflight = None
            self._set([self.anchor] * len(self.models))


def simulate(
    x: torch.Tensor,
    y: torch.Tensor,
    shares: list[int],
    overlap: bool,
    inner: int | None = None,
    outer: tuple[float, float] = (OUTER_LR, MU),
) -> dict[str, torch.Tensor]:
    sim = Simulation(shares, overlap, inner, outer)
    perm = torch.from_numpy(epoch_permutation(SEED, 0, len(y)))
    for step in range(steps_per_epoch(len(y), GLOBAL_BATCH)):
        sim.step(x, y, perm[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], (step + 1) % H == 0)
        if (step + 1) % H == 0:
            sim.exchange()
        if (step + 1) % ROUND == 0:
            sim.end_round()
    return sim.models[0].state_dict()


PIECE_MB = "0.0003814697265625"  # 400 bytes: the mlp's 1,285 weights travel in 13 pieces of 100 values


@pytest.mark.parametrize(
    "overlap,pace,outer,bucket_mb",
    [
        (False, "balanced", (OUTER_LR, MU), None),
        (False, "balanced", (1.0, 0.0), None),  # the defaults: plain averaging, no momentum buffer at all
        (False, "balanced", (1.0, 0.0), PIECE_MB),  # in pieces across the parameters' edges
        (True, "balanced", (OUTER_LR, MU), None),
        (True, "per-device", (OUTER_LR, MU), None),
    ],
    ids=["plain", "plain-averaging", "plain-averaging-in-pieces", "overlapped", "overlapped-per-device-pace"],
)
def test_local_sgd_matches_a_one_process_simulation_of_its_math(overlap, pace, outer, bucket_mb, tmp_path, monkeypatch):
    if bucket_mb:
        monkeypatch.setenv("MIXTRAIN_BUCKET_MB", bucket_mb)
    x, y = data("mlp", NUM_SAMPLES)
    options = LocalSGDConfig(local_steps=H, outer_lr=outer[0], outer_momentum=outer[1], overlap=overlap, pace=pace)
    strategy = StrategyConfig(name="local-sgd", local_sgd=options)
    result = train("mlp", "sgd0", [40, 24], x, y, tmp_path, steps_per_round=ROUND, strategy=strategy)
    assert [r["num_steps"] for r in result.history] == [ROUND] * 4
    assert all(r["drift"] == 0.0 for r in result.history)  # replicas are equal at every round's end
    # every window of H steps is exchanged once, with or without overlap: a round sends ROUND / H deltas
    sent = {w["sent_bytes"] for r in result.history for w in r["workers"]}
    assert len(sent) == 1, sent
    if bucket_mb:  # every piece went: the same bytes as one collective
        assert sent == {ROUND // H * (1285 + 2 * H) * 4}, sent
    # per-device pace: each worker's inner batch is 64 / 2 = 32 samples; in a window of H=2 steps worker 0 (40
    # a step) steps on 32, 32 and, at the exchange, the 16 left; worker 1 (24 a step) on 32 and the 16 left
    inner = GLOBAL_BATCH // 2 if pace == "per-device" else None
    want = simulate(x, y, [40, 24], overlap, inner, outer)
    assert_same_weights(result.state_dict, want)
    # and they differ: the test can tell overlap from none, and the paces apart
    if inner:
        other = simulate(x, y, [40, 24], overlap, None, outer)
    else:
        other = simulate(x, y, [40, 24], not overlap, outer=outer)
    assert any(not torch.allclose(want[k], other[k], rtol=1e-4) for k in want)


def test_overlapped_rounds_hold_several_exchanges_and_the_last_blocks(tmp_path):
    # rounds sized by time hold at least 4 exchanges when overlapped; the ledger still reports every step
    x, y = data("mlp", NUM_SAMPLES)
    strategy = StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=H, overlap=True))
    result = train("mlp", "sgd0", [32, 32], x, y, tmp_path, steps_per_round=None, strategy=strategy)
    steps = [r["num_steps"] for r in result.history]
    assert sum(steps) == 32 and all(n >= 4 * H or r["first_step"] + n == 32 for n, r in zip(steps, result.history))
    assert all(r["drift"] == 0.0 for r in result.history)
    assert len(run_records(result.run_dir, "round")) == len(steps)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "plain-averaging-in-pieces"])
def test_a_worker_killed_mid_exchange_is_survived(overlap, tmp_path, monkeypatch):
    # worker 1 of 3 SIGKILLs itself at its 8th step, with an exchange in flight (overlapped), or just before
    # one that travels in pieces: the survivors fail in the wait for it, go back to the common point (the
    # in-flight window and the one after are redone), re-form and go on; every step is done once, and the two
    # survivors end equal
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    if not overlap:
        monkeypatch.setenv("MIXTRAIN_BUCKET_MB", PIECE_MB)
    x, y = data("mlp", NUM_SAMPLES)
    task = functools.partial(faulty_task, "mlp", "sgd0", "kill", 1, 8, str(tmp_path / "fired"))
    strategy = StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=H, overlap=overlap))
    result = Trainer(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=3, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=ROUND, progress=False, rejoin=False),
        strategy=strategy,
    ).fit(epochs=1)
    assert (tmp_path / "fired").exists()
    [failure] = run_records(result.run_dir, "failure")
    assert [w["worker"]["rank"] for w in failure["lost"]] == [1]
    widths = [len(r["shares"]) for r in result.history]
    assert widths[0] == 3 and widths[-1] == 2, widths
    steps = [(r["first_step"], r["num_steps"]) for r in result.history]
    assert sum(n for _, n in steps) == 32 and sorted(steps) == steps, steps
    assert all(r["drift"] == 0.0 for r in result.history)
    assert all(torch.isfinite(v).all() for v in result.state_dict.values())


def straight_and_resumed(tmp_path, opt: str, samples: int, strategy: StrategyConfig):
    """The same local-SGD run twice: 2 epochs straight, and 1 epoch then a resume to 2 (shares 40:24)."""
    x, y = data("mlp", samples)

    def fit(run_dir, epochs, resume=None):
        return Trainer(
            factory("mlp", opt),
            (x, y),
            global_batch=GLOBAL_BATCH,
            scaling=ScalingConfig(num_workers=2, shares=[40, 24]),
            run=RunConfig(run_dir=str(run_dir), seed=SEED, steps_per_round=ROUND, progress=False),
            strategy=strategy,
        ).fit(epochs=epochs, resume=resume)

    straight = fit(tmp_path / "straight", 2)
    fit(tmp_path / "stopped", 1)
    return straight, fit(tmp_path / "stopped", 2, resume=tmp_path / "stopped")


def test_resume_continues_exactly_with_the_outer_momentum(tmp_path):
    # the outer optimizer's momentum is in every checkpoint; the inner SGD keeps no state and the replicas
    # are equal at every round's end, so 1 epoch + resume to 2 equals 2 epochs straight (overlapped, per-device
    # pace, unequal shares, DiLoCo's momentum)
    options = LocalSGDConfig(local_steps=H, outer_lr=OUTER_LR, outer_momentum=MU, overlap=True, pace="per-device")
    strategy = StrategyConfig(name="local-sgd", local_sgd=options)
    straight, resumed = straight_and_resumed(tmp_path, "sgd0", GLOBAL_BATCH * 10, strategy)
    # (without the momentum restored, the first layer differed by 3.6e-2)
    assert_same_weights(resumed.state_dict, straight.state_dict, rtol=1e-6)


@pytest.mark.parametrize("compress", ["none", "int8"])
def test_resume_gives_every_replica_its_own_inner_optimizer_and_error_feedback(tmp_path, compress):
    # each replica's inner AdamW moments (and, with int8, what quantization dropped from its last delta) are its
    # own: a checkpoint held rank 0's only, and a resumed overlapped int8 run at H=4 ended up to 0.15 away from
    # the run it continued (issue 46). Now each rank gets its own back: 1 epoch + resume to 2 equals 2 straight
    options = LocalSGDConfig(local_steps=4, outer_lr=OUTER_LR, outer_momentum=MU, overlap=True)
    strategy = StrategyConfig(name="local-sgd", local_sgd=options, compress=compress)
    straight, resumed = straight_and_resumed(tmp_path, "adamw", GLOBAL_BATCH * 8, strategy)
    for name, want in straight.state_dict.items():  # bit for bit
        assert torch.equal(resumed.state_dict[name], want), name
