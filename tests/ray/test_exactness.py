"""The core promise: any split of the global batch trains exactly like one process with the whole batch."""

import copy

import pytest
import torch

from mixtrain import RunConfig, ScalingConfig, Trainer, load_weights
from mixtrain.data.sampling import epoch_permutation, steps_per_epoch
from tests.models import data, factory, make_task

pytestmark = pytest.mark.usefixtures("ray_session")

GLOBAL_BATCH = 64
NUM_SAMPLES = 64 * 29 + 20  # 30 steps; the last one is a partial batch of 20
SEED = 7


def reference(
    model: str, opt: str, x: torch.Tensor, y: torch.Tensor, epochs: int = 1, max_steps: int | None = None
) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: batch 64 in each epoch's sample order (the first `max_steps` steps)."""
    torch.manual_seed(SEED)
    task = make_task(model, opt)
    num_steps = steps_per_epoch(len(y), GLOBAL_BATCH)
    for epoch in range(epochs):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(y)))
        for step in range(num_steps):
            if max_steps is not None and epoch * num_steps + step >= max_steps:
                break
            idx = perm[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
            task.optimizer.zero_grad()
            task.loss_fn(task.model(x[idx]), y[idx]).backward()
            task.optimizer.step()
    return task.model.state_dict()


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        err = (got[name].double() - want[name].double()).norm() / want[name].double().norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol}"


def train(model, opt, shares, x, y, tmp_path, steps_per_round=7, eval_data=None, strategy="allreduce"):
    trainer = Trainer(
        factory(model, opt),
        (x, y),
        eval_data=eval_data,
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=len(shares), shares=shares),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=steps_per_round, progress=False),
        strategy=strategy,
    )
    return trainer.fit(epochs=1)


@pytest.mark.parametrize(
    "model,opt,shares",
    [
        ("mlp", "adamw", [64]),  # one worker: autograd's own gradients, no bucket views, no collective
        ("mlp", "sgd", [40, 24]),
        ("mlp", "adamw", [40, 24]),
        ("mlp", "sgd", [30, 20, 14]),
        ("mlp", "adamw", [30, 20, 14]),
        ("cnn", "sgd", [30, 20, 14]),
        ("cnn", "adamw", [40, 24]),
    ],
)
def test_unequal_shares_match_single_process(model, opt, shares, tmp_path):
    x, y = data(model, NUM_SAMPLES)
    result = train(model, opt, shares, x, y, tmp_path)
    assert sum(r["num_steps"] for r in result.history) == 30
    assert sum(r["samples"] for r in result.history) == NUM_SAMPLES
    assert_same_weights(result.state_dict, reference(model, opt, x, y))
    # the saved file holds the same weights
    saved = load_weights(result.model_path)
    assert all(torch.equal(saved[k], result.state_dict[k]) for k in saved)


def bn_reference(shares: list[int], x: torch.Tensor, y: torch.Tensor, steps_per_round: int) -> dict[str, torch.Tensor]:
    """The documented BatchNorm semantics, in one process: each worker's replica normalises its own
    slice (no SyncBatchNorm), gradients are the sample-weighted sum, and running statistics are
    averaged weighted by share at the end of every round."""
    torch.manual_seed(SEED)
    task = make_task("bn", "sgd")
    copies = [task.model] + [copy.deepcopy(task.model) for _ in shares[1:]]
    perm = torch.from_numpy(epoch_permutation(SEED, 0, len(y)))
    num_steps = steps_per_epoch(len(y), GLOBAL_BATCH)
    for step in range(num_steps):
        idx = perm[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        assert len(idx) == GLOBAL_BATCH, "keep this reference to full batches"
        task.optimizer.zero_grad()
        grads = [torch.zeros_like(p) for p in task.model.parameters()]
        lo = 0
        for replica, b in zip(copies, shares):
            replica.zero_grad()
            part = idx[lo : lo + b]
            (task.loss_fn(replica(x[part]), y[part]) * (b / GLOBAL_BATCH)).backward()
            grads = [g + p.grad for g, p in zip(grads, replica.parameters())]
            lo += b
        for p, g in zip(task.model.parameters(), grads):
            p.grad = g
        task.optimizer.step()
        for replica in copies[1:]:
            for p, p0 in zip(replica.parameters(), task.model.parameters()):
                p.data.copy_(p0.data)
        if (step + 1) % steps_per_round == 0 or step + 1 == num_steps:
            for name, buf in task.model.named_buffers():
                if buf.is_floating_point():
                    mean = sum(
                        dict(r.named_buffers())[name].double() * (b / GLOBAL_BATCH) for r, b in zip(copies, shares)
                    )
                    for r in copies:
                        dict(r.named_buffers())[name].copy_(mean)
    return task.model.state_dict()


def test_batchnorm_semantics_local_statistics_and_weighted_running_averages(tmp_path):
    shares = [40, 24]
    x, y = data("bn", 64 * 12)
    one_sample = (x[:1], y[:1])  # fewer held-out samples than workers: one worker evaluates, one idles
    result = train("bn", "sgd", shares, x, y, tmp_path, steps_per_round=5, eval_data=one_sample)
    assert result.evals[-1]["samples"] == 1 and result.evals[-1]["accuracy"] in (0.0, 1.0)
    assert_same_weights(result.state_dict, bn_reference(shares, x, y, steps_per_round=5))
    # and it is NOT single-process training (the forward normalises per worker): the doc is honest
    plain = reference("bn", "sgd", x, y)
    diff = (result.state_dict["1.running_var"] - plain["1.running_var"]).abs().max()
    assert diff > 1e-4


def test_fewer_samples_than_workers_trains_and_evaluates_exactly(tmp_path):
    # 3 workers, 2 training samples, 1 held-out sample: the one step has shares 1, 1, 0 and evaluation
    # slices 1, 0, 0; workers with no samples still join every collective.
    x, y = data("mlp", 3)
    trainer = Trainer(
        factory("mlp", "adamw"),
        (x[:2], y[:2]),
        eval_data=(x[2:], y[2:]),
        global_batch=3,
        scaling=ScalingConfig(num_workers=3, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, progress=False),
    )
    result = trainer.fit(epochs=2)
    assert [len(r["shares"]) for r in result.history] == [3, 3] and result.evals[-1]["samples"] == 1
    torch.manual_seed(SEED)
    task = make_task("mlp", "adamw")
    for epoch in range(2):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, 2))
        task.optimizer.zero_grad()
        task.loss_fn(task.model(x[perm]), y[perm]).backward()
        task.optimizer.step()
    assert_same_weights(result.state_dict, task.model.state_dict())
