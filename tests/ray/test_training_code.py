"""Code from elsewhere through the door, with the exactness promise kept: dict batches and compute_loss,
clipping on the reduced gradient, a random-augmentation Dataset read lazily through loader processes,
micro-batching over a Dataset, data built on each worker, and a Hugging Face model."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

import mixtrain
from mixtrain import PSConfig, RunConfig, ScalingConfig, StrategyConfig, Task, Trainer, WorkerError
from mixtrain.checkpoint import CheckpointStore
from mixtrain.data import Loader, seed_sample
from mixtrain.data.sampling import epoch_permutation, steps_per_epoch
from mixtrain.group.preflight import PreflightError
from tests.datasets import Augmented, DictSamples, clipped_task, dict_task, first_come_dataset, read_counts
from tests.models import data, make_task
from tests.ray.test_exactness import assert_same_weights

pytestmark = pytest.mark.usefixtures("ray_session")

B = 64
N = 64 * 12 + 20  # 13 steps; the last one is a partial batch of 20
SEED = 7


def run(factory, train, tmp_path, shares, epochs=1, eval_data=None, **scaling):
    trainer = Trainer(
        factory,
        train,
        eval_data=eval_data,
        global_batch=B,
        scaling=ScalingConfig(num_workers=len(shares), shares=shares, **scaling),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=5, progress=False),
    )
    return trainer.fit(epochs=epochs)


def reference(task: Task, read, num_samples: int, epochs: int = 1) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: the whole batch of each step in the epoch's order; `read(epoch, idx)`
    makes the batch. Clips with clip_grad_norm_ on the whole batch's gradient when the task asks."""
    for epoch in range(epochs):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, num_samples))
        for step in range(steps_per_epoch(num_samples, B)):
            idx = perm[step * B : (step + 1) * B]
            task.optimizer.zero_grad()
            task.batch_loss(task.model, read(epoch, idx)).backward()
            if task.max_grad_norm is not None:
                nn.utils.clip_grad_norm_(task.model.parameters(), task.max_grad_norm)
            task.optimizer.step()
    return task.model.state_dict()


def seeded_read(dataset):
    """The documented augmentation contract: seed_sample(seed, epoch, i) before dataset[i]."""

    def read(epoch, idx):
        samples = []
        for i in idx.tolist():
            seed_sample(SEED, epoch, i)
            samples.append(dataset[i])
        return default_collate(samples)

    return read


def test_dict_batches_with_compute_loss_and_metrics_match_single_process(tmp_path):
    x, y = data("mlp", N)
    xe, ye = data("mlp", 100, seed=3)
    result = run(dict_task, DictSamples(x, y), tmp_path, [30, 20, 14], eval_data=DictSamples(xe, ye))
    torch.manual_seed(SEED)
    want = reference(dict_task(), seeded_read(DictSamples(x, y)), N)
    assert_same_weights(result.state_dict, want)
    ev = result.evals[-1]
    assert ev["samples"] == 100 and 0.0 <= ev["hits"] <= 1.0 and "accuracy" not in ev  # the task's own metric
    model = dict_task().model
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        assert ev["loss"] == pytest.approx(float(nn.functional.cross_entropy(model(xe), ye)), rel=1e-4)
        assert ev["hits"] == pytest.approx(float((model(xe).argmax(-1) == ye).double().mean()), abs=1e-12)


@pytest.mark.parametrize("opt,caps", [("adamw", None), ("sgd", None), ("adamw", [8, 5, 3])])
def test_clipping_the_reduced_gradient_matches_single_process(opt, caps, tmp_path):
    x, y = data("mlp", N)
    max_norm = 0.05  # far under the gradients' norm: most steps clip
    result = run(functools.partial(clipped_task, opt, max_norm), (x, y), tmp_path, [30, 20, 14], max_micro_batch=caps)
    torch.manual_seed(SEED)
    want = reference(clipped_task(opt, max_norm), lambda e, idx: (x[idx], y[idx]), N)
    assert_same_weights(result.state_dict, want)
    norms = [r["grad_norm"] for r in result.history]
    assert all(n is not None and n > max_norm for n in norms), norms  # it did clip, and the norm was logged


def test_an_augmented_dataset_through_loader_processes_matches_single_process_and_reads_each_sample_once(tmp_path):
    x, y = data("mlp", N)
    counts = tmp_path / "counts"
    counts.mkdir()
    dataset = Augmented(x, y, str(counts))
    result = run(
        functools.partial(make_task, "mlp", "sgd"),
        Loader(dataset=dataset, num_workers=2),
        tmp_path / "run",
        [40, 24],
        epochs=2,
    )
    torch.manual_seed(SEED)
    want = reference(make_task("mlp", "sgd"), seeded_read(Augmented(x, y)), N, epochs=2)
    assert_same_weights(result.state_dict, want)
    # every sample read once per epoch, on demand; before training, each worker reads the first B / 2 samples
    # once (its probe batch, which the shape check's sample is one of): the probe times its steps on them
    reads = read_counts(str(counts))
    probe_batch = B // 2
    print(f"reads: {sum(reads.values())} of {N} samples in 2 epochs, {sum(reads.values()) - 2 * N} beyond them")
    assert all(reads.get(i, 0) == 2 for i in range(probe_batch, N)), {
        i: reads.get(i, 0) for i in range(probe_batch, N) if reads.get(i) != 2
    }
    assert all(reads.get(i, 0) <= 2 + 2 for i in range(probe_batch)), reads  # 2 epochs + once per worker
    assert sum(reads.values()) <= 2 * N + 2 * probe_batch, sum(reads.values())


def test_micro_batches_over_a_dataset_match_single_process(tmp_path):
    x, y = data("mlp", N)
    result = run(
        functools.partial(make_task, "mlp", "adamw"), Augmented(x, y), tmp_path, [40, 24], max_micro_batch=[8, 5]
    )
    assert [w["memory_bytes"] is not None for w in result.history[-1]["workers"]] == [True, True]
    torch.manual_seed(SEED)
    want = reference(make_task("mlp", "adamw"), seeded_read(Augmented(x, y)), N)
    assert_same_weights(result.state_dict, want)


@pytest.mark.parametrize("what,field", [("length", "num_train"), ("content", "train_fingerprint")])
def test_data_built_on_each_worker_must_agree(what, field, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    with pytest.raises(PreflightError) as err:
        run(dict_task, functools.partial(first_come_dataset, str(markers), what), tmp_path / "run", [32, 32])
    text = str(err.value)
    first_line = text.splitlines()[0]
    assert first_line.startswith("the workers' data differ (") and field in first_line
    assert "worker 0" in text and "worker 1" in text
    assert "nothing was trained" in text and "Fix: every machine needs the same files" in text


def _scalar_free_task() -> Task:
    m = nn.Linear(20, 5)
    return Task(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), compute_loss=lambda model, b: model(b["x"]))


def test_a_compute_loss_that_returns_no_scalar_fails_fast_naming_the_field(tmp_path):
    x, y = data("mlp", 128)
    with pytest.raises(WorkerError, match=r"Task.compute_loss returned a tensor of shape \(\d+, 5\); it must return"):
        run(_scalar_free_task, DictSamples(x, y), tmp_path, [32, 32])


@pytest.mark.parametrize("strategy,opt", [("ps", "adamw"), ("ps-async", "sgd")])
def test_parameter_servers_clip_by_the_global_norm_across_shards_exactly(strategy, opt, tmp_path):
    """Two shards each hold half the parameters; clipping needs the norm over both (ps-async with its
    default staleness 0 bound is the synchronous schedule). Workers 0 and 2 run micro-batches, which add up in
    the gradients' flat buffer before each push."""
    x, y = data("mlp", N)
    max_norm = 0.05
    trainer = Trainer(
        functools.partial(clipped_task, opt, max_norm),
        (x, y),
        global_batch=B,
        scaling=ScalingConfig(num_workers=3, shares=[30, 20, 14], max_micro_batch=[8, 64, 5]),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=5, progress=False),
        strategy=StrategyConfig(name=strategy, ps=PSConfig(shards=2, staleness=0)),
    )
    result = trainer.fit(epochs=1)
    torch.manual_seed(SEED)
    want = reference(clipped_task(opt, max_norm), lambda e, idx: (x[idx], y[idx]), N)
    assert_same_weights(result.state_dict, want)
    assert all(r["grad_norm"] is not None and r["grad_norm"] > max_norm for r in result.history)


def test_a_hugging_face_gpt2_trains_on_dict_batches_and_its_held_out_loss_falls(tmp_path):
    pytest.importorskip("transformers")
    from mixtrain.examples import gpt2

    job = gpt2.example(max_chars=40_000, data_dir=str(tmp_path / "tokens"))
    result = job.trainer(
        scaling=ScalingConfig(num_workers=2),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, progress=False, keep_best=("loss", "min")),
    ).fit(epochs=2)
    first, last = result.evals[0]["loss"], result.evals[-1]["loss"]
    assert last < first < gpt2.uniform_loss(job) and last < gpt2.uniform_loss(job) - 1.0
    # the final weights as a Hugging Face folder: AutoModelForCausalLM loads them exactly, the tied lm_head
    # included, and scores the held-out text as the run did
    from transformers import AutoModelForCausalLM

    assert result.hf_model_path == result.run_dir / "hf_model"
    loaded = AutoModelForCausalLM.from_pretrained(result.hf_model_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    for name, want in result.state_dict.items():
        assert torch.equal(loaded.state_dict()[name], want), name
    held = gpt2.gpt2_windows("held", 40_000, str(tmp_path / "tokens"))
    batch = default_collate([held[i] for i in range(len(held))])
    with torch.no_grad():
        assert float(loaded(**batch).loss) == pytest.approx(last, rel=1e-5)
    # the best checkpoint (keep_best), written the same way by fit; and any checkpoint, exported by hand
    assert result.best_checkpoint is not None and (result.run_dir / "hf_best" / "config.json").is_file()
    best = AutoModelForCausalLM.from_pretrained(result.run_dir / "hf_best").state_dict()
    for name, want in CheckpointStore.read(result.best_checkpoint)[0]["model"].items():
        assert torch.equal(best[name], want), name
    oldest = CheckpointStore(result.run_dir).paths()[-1]
    exported = mixtrain.export_pretrained(oldest, result.run_dir / "hf_oldest")
    for name, want in CheckpointStore.read(oldest)[0]["model"].items():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(exported).state_dict()[name], want), name
    # README: the weights file into a fresh model, for any model
    model = job.task_factory().model
    model.load_state_dict(mixtrain.load_weights(result.model_path))
    for name, want in result.state_dict.items():
        assert torch.equal(model.state_dict()[name], want), name
