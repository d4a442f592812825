"""Fault injection with real processes: a worker SIGKILLed or SIGSTOPped mid-round, NaN from one
worker, and checkpoints that resume exactly. Training must go on (or stop with the documented error),
match single-process training, leave only checkpoints that verify, and never hang."""

import functools
import os
from pathlib import Path

import pytest
import torch

from mixtrain import LocalSGDConfig, PSConfig, RunConfig, ScalingConfig, StrategyConfig, Trainer
from mixtrain.checkpoint import MANIFEST_SHA256, CheckpointStore, _manifest_digest
from mixtrain.data.sampling import steps_per_epoch
from mixtrain.driver.controller import TrainingStopped
from mixtrain.group.worker_group import WorkerGroup
from mixtrain.worker.replica import TrainWorker
from tests.conftest import run_records
from tests.models import data, eval_memory_task, factory, faulty_task, with_a_slow_first_step
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def fit(task_factory, tmp_path, workers=3, epochs=1, resume=None, strategy="allreduce", **run):
    x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        task_factory,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=workers, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(
            run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=2, progress=False, checkpoint_every_s=0, **run
        ),
        strategy=strategy,
    )
    return trainer.fit(epochs=epochs, resume=resume), (x, y)


def all_checkpoints_verify(run_dir):
    store = CheckpointStore(run_dir)
    assert store.paths(), "no checkpoint was written"
    for path in store.paths():
        store.verify(path)
    assert not list(store.root.glob(".tmp-*"))


@pytest.mark.parametrize("fault,at_call", [("kill", 8), ("stop", 7)])
def test_a_worker_lost_mid_round_is_survived_and_training_stays_exact(tmp_path, monkeypatch, fault, at_call):
    # Worker 1 of 3 SIGKILLs itself in the second step of a round (step 7), or SIGSTOPs itself in the
    # first (step 6). The other two notice (a closed connection at once; a stopped peer after the 5 s
    # collective timeout), keep the steps of the round they committed (none, or step 6), re-form the
    # group and go on from there: no state copy, same math as one process.
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    task = functools.partial(faulty_task, "mlp", "sgd", fault, 1, at_call, str(tmp_path / "fired"))
    result, (x, y) = fit(task, tmp_path, rejoin=False)
    assert (tmp_path / "fired").exists()
    [failure] = run_records(result.run_dir, "failure")
    assert [w["worker"]["rank"] for w in failure["lost"]] == [1] and failure["failures"] == 1
    reason = failure["lost"][0]["reason"]
    assert ("process died" in reason) if fault == "kill" else ("did not answer within" in reason), reason
    widths = [len(r["shares"]) for r in result.history]
    assert widths[0] == 3 and widths[-1] == 2, widths
    steps = [(r["first_step"], r["num_steps"]) for r in result.history]
    assert sum(n for _, n in steps) == 30 and sorted(steps) == steps  # every step once, in order
    partial = [(r["first_step"], r["num_steps"]) for r in result.history if r.get("partial")]
    assert partial == ([(6, 1)] if at_call == 8 else []), partial  # the step committed before the loss stands
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))
    all_checkpoints_verify(result.run_dir)


@pytest.mark.parametrize(
    "strategy,opt",
    [
        (StrategyConfig(name="ps", ps=PSConfig(shards=2)), "sgd"),
        (
            StrategyConfig(name="local-sgd", local_sgd=LocalSGDConfig(local_steps=1, outer_lr=1.0, outer_momentum=0.0)),
            "sgd0",
        ),
    ],
    ids=["ps", "local-sgd"],
)
def test_a_worker_killed_under_another_strategy_is_survived_exactly(tmp_path, monkeypatch, strategy, opt):
    # Killed in the second step of a round. With parameter servers the survivors notice through the
    # shards, which wait for the dead worker's gradient until the collective timeout; the shards go back
    # to the restore point they took at the round's start (one update was applied since) and the round
    # is redone. Local SGD (H=1) keeps the step whose exchange completed.
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "5")
    task = functools.partial(faulty_task, "mlp", opt, "kill", 1, 8, str(tmp_path / "fired"))
    result, (x, y) = fit(task, tmp_path, rejoin=False, strategy=strategy)
    [failure] = run_records(result.run_dir, "failure")
    assert [w["worker"]["rank"] for w in failure["lost"]] == [1]
    widths = [len(r["shares"]) for r in result.history]
    assert widths[0] == 3 and widths[-1] == 2, widths
    assert sum(r["num_steps"] for r in result.history) == 30
    assert_same_weights(result.state_dict, reference("mlp", opt, x, y))
    all_checkpoints_verify(result.run_dir)


def test_a_replacement_rejoins_at_a_round_boundary_with_the_current_state(tmp_path):
    # Worker 1 is SIGKILLed at its 5th step; its bundle is free again, so a replacement process starts
    # there, builds its replica, receives rank 0's current state and joins between rounds. The two
    # survivors wait for the replacement's build before each step (however long a loaded machine takes to
    # start a process), so it joins at the first round boundary after; still single-process training.
    task = functools.partial(faulty_task, "mlp", "sgd", "kill", 1, 5, str(tmp_path / "fired"), 0.0, 3)
    result, (x, y) = fit(task, tmp_path)
    widths = [len(r["shares"]) for r in result.history]
    print("workers per round:", widths)
    assert widths[0] == 3 and 2 in widths and widths[-1] == 3, widths
    [joined] = run_records(result.run_dir, "rejoined")
    assert joined["step"] > 4 and joined["worker"]["pid"] not in [w["pid"] for w in result.workers]
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))
    all_checkpoints_verify(result.run_dir)


class DiesOnceWhenAdmitted(TrainWorker):
    """A replacement (started outside the group, rank -1) whose process dies the first time it is in
    `DIE_IN` (a laptop on a flapping Wi-Fi). It takes along the marker that faulty_task's survivors wait on, so
    they wait for the next replacement, which joins. Its files are next to the run folder."""

    DIE_IN = ""

    def _setup(self, setup):
        super()._setup(setup)
        self._folder = Path(setup.log_to[0]).parent.parent if setup.log_to and setup.rank < 0 else None

    def _die_once_in(self, method):
        if self._folder is not None and method == self.DIE_IN and not (self._folder / "died").exists():
            (self._folder / "died").touch()
            (self._folder / "fired.replacement").unlink()
            os._exit(1)

    def load_data(self, *args):
        self._die_once_in("load_data")
        return super().load_data(*args)

    def join(self, *args):
        self._die_once_in("join")
        return super().join(*args)


class DiesInLoadData(DiesOnceWhenAdmitted):
    DIE_IN = "load_data"


class DiesInJoin(DiesOnceWhenAdmitted):
    DIE_IN = "join"


@pytest.mark.parametrize("worker_cls", [DiesInLoadData, DiesInJoin], ids=["loading-data", "forming-the-group"])
def test_a_replacement_that_dies_while_being_admitted_is_dropped_and_training_goes_on(
    tmp_path, monkeypatch, worker_cls
):
    # Worker 1 is SIGKILLed at its 5th step; its replacement's process dies while being admitted (Ray's
    # RayActorError once escaped GroupOps.admit and ended the run). It is dropped with a note, the two others
    # go on, and the next replacement joins; still single-process training.
    monkeypatch.setenv("MIXTRAIN_RENDEZVOUS_TIMEOUT_S", "10")  # the survivors' wait for a peer that died joining

    class Group(WorkerGroup):
        pass

    Group.worker_cls = worker_cls

    class DyingReplacements(Trainer):
        worker_group_cls = Group

    x, y = data("mlp", NUM_SAMPLES)
    task = functools.partial(faulty_task, "mlp", "sgd", "kill", 1, 5, str(tmp_path / "fired"), 0.0, 3)
    result = DyingReplacements(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=3, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=2, progress=False),
    ).fit(epochs=2)  # room for two replacements, one after the other, on a loaded machine
    assert (tmp_path / "died").exists()
    [dropped] = run_records(result.run_dir, "replacement_refused")
    assert "dropped while" in dropped["reason"], dropped
    widths = [len(r["shares"]) for r in result.history]
    assert widths[0] == 3 and 2 in widths and widths[-1] == 3, widths
    assert len(run_records(result.run_dir, "rejoined")) == 1
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y, epochs=2))


def test_failure_budget_spent_stops_with_an_intact_checkpoint(tmp_path):
    task = functools.partial(faulty_task, "mlp", "sgd", "kill", 1, 7, str(tmp_path / "fired"))
    with pytest.raises(TrainingStopped, match=r"1 failures within 60 minutes, max_failures=0.*is intact; continue"):
        fit(task, tmp_path, max_failures=0)
    all_checkpoints_verify(tmp_path / "run")


def test_nan_from_one_worker_skips_steps_then_stops_naming_it(tmp_path):
    task = functools.partial(faulty_task, "mlp", "sgd", "nan", 2, 5, str(tmp_path / "unused"))
    with pytest.raises(TrainingStopped) as err:
        fit(task, tmp_path, max_nonfinite_steps=4)
    text = str(err.value)
    assert "4 steps in a row" in text and "worker 2 (" in text and "from step 4" in text, text
    rounds = run_records(tmp_path / "run", "round")
    assert sum(len(r["skipped_steps"]) for r in rounds) == 4
    all_checkpoints_verify(tmp_path / "run")


def test_stopped_after_step_k_and_resumed_equals_an_uninterrupted_run(tmp_path):
    # Run 1 epoch, then resume to 2 epochs from its checkpoint; vs 2 epochs straight.
    first, _ = fit(factory("mlp", "adamw"), tmp_path, workers=2, epochs=1)
    manifest = CheckpointStore(first.run_dir).latest()[1]  # what fixes the sample order, checked on resume
    assert manifest["seed"] == SEED and len(manifest["data_fingerprint"]) == 16
    resumed, _ = fit(factory("mlp", "adamw"), tmp_path, workers=2, epochs=2, resume=first.run_dir)
    assert resumed.history[0]["epoch"] == 1 and resumed.history[0]["first_step"] == 0
    straight, _ = fit(factory("mlp", "adamw"), tmp_path / "straight", workers=2, epochs=2)
    for name, want in straight.state_dict.items():
        err = (resumed.state_dict[name] - want).abs().max().item()
        assert err <= 1e-6, (name, err)


def test_a_node_removed_from_the_cluster_mid_run_is_survived(tmp_path):
    from tests.conftest import run_cluster_script

    out = run_cluster_script("cluster_node_loss.py", timeout=300, MIXTRAIN_COLLECTIVE_TIMEOUT_S="10")
    [failure] = out["failures"]
    assert len(failure["lost"]) == 1 and "node left" in failure["lost"][0]["reason"], failure
    assert out["widths"][0] == 3 and out["widths"][-1] == 2, out["widths"]
    assert out["exact"] == "yes", out["exact"]


def test_out_of_memory_mid_run_halves_the_micro_batch_and_training_stays_exact(tmp_path, monkeypatch):
    # Worker 1 runs out of memory for any micro-batch over 10 samples (its share is about 21 of 64): the
    # round goes on from its committed steps with micro-batch 10, then 5, by gradient accumulation; nobody
    # is lost, and the weights are one process's. Worker 2 reaches the first step's collective 5 s late (a
    # loaded machine): the closed connection worker 1 leaves behind is no sign that worker 2 is gone, so it
    # is not declared lost after MIXTRAIN_LOST_GRACE_S (3 s here), as it once was.
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "10")
    oom = functools.partial(faulty_task, "mlp", "sgd", "oom", 1, 10, str(tmp_path / "unused"))
    task = functools.partial(with_a_slow_first_step, oom, 2, 5.0)
    result, (x, y) = fit(task, tmp_path, rejoin=False)
    events = run_records(result.run_dir, "out_of_memory")
    assert 1 <= len(events) <= 2 and all(e["ranks"] == [1] for e in events), events
    assert events[-1]["memory_caps"][1] <= 10 and not run_records(result.run_dir, "failure")
    assert all(len(r["shares"]) == 3 for r in result.history)
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_a_worker_out_of_memory_even_at_one_sample_is_left_out_and_training_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXTRAIN_COLLECTIVE_TIMEOUT_S", "10")
    task = functools.partial(faulty_task, "mlp", "sgd", "oom", 2, 0, str(tmp_path / "unused"))
    result, (x, y) = fit(task, tmp_path, rejoin=False)
    [gone] = run_records(result.run_dir, "left_out")
    assert gone["worker"]["rank"] == 2 and "out of memory at micro-batch 1" in gone["reason"]
    assert len(result.history[-1]["shares"]) == 2
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_evaluation_out_of_memory_halves_its_batch_and_a_worker_with_no_room_hands_its_slice_on(tmp_path):
    """Worker 1's card holds 4 held-out samples at a time, worker 2's not one (a 12 GB card, a Mac): the fit
    ends, and its held-out figures are one process's over the whole held-out set with the final weights."""
    from tests.models import MODELS, _EvalMemory

    x, y = data("mlp", NUM_SAMPLES)
    ex, ey = data("mlp", 150, seed=7)
    trainer = Trainer(
        functools.partial(eval_memory_task, "mlp", "sgd", {1: 4, 2: 0}),
        (x, y),
        eval_data=(ex, ey),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=3, cpus_per_worker=0.5, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path / "run"), seed=SEED, steps_per_round=4, progress=False),
    )
    result = trainer.fit(epochs=2)
    assert len(result.evals) == 2 and all(e["samples"] == 150 for e in result.evals)
    model = _EvalMemory(MODELS["mlp"](), {})
    model.load_state_dict(result.state_dict)
    model.eval()
    with torch.no_grad():
        out = model(ex)
    assert result.evals[-1]["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(out, ey)), rel=1e-5)
    assert result.evals[-1]["accuracy"] == pytest.approx(float((out.argmax(-1) == ey).float().mean()))
    notes = run_records(result.run_dir, "eval_out_of_memory")
    assert len(notes) == 2 and all("worker 2" in n["note"] and "went to the others" in n["note"] for n in notes)
    logs = "".join(p.read_text() for p in (Path(result.run_dir) / "logs").glob("worker-1-*.log"))
    assert logs.count("batch halved") >= 1 and "batch halved to 4" in logs  # kept for the second evaluation
    assert not run_records(result.run_dir, "failure") and len(result.history[-1]["shares"]) == 3


def test_resuming_at_the_very_end_of_an_epoch_evaluates_it_and_goes_on(tmp_path):
    """A Ctrl-C that lands after an epoch's last round stops at (epoch, its last step): resuming there goes
    straight to that epoch's end, its evaluation, with none of its rounds in this process. Found by the CLI's
    Ctrl-C test in a fresh-clone run (an IndexError in the epoch line); here the checkpoint's position is set
    to that point directly, so the test does not depend on when a signal lands."""
    import json

    x, y = data("mlp", NUM_SAMPLES)

    def trainer(run_dir):
        return Trainer(
            factory("mlp", "sgd"),
            (x, y),
            eval_data=(x[:64], y[:64]),
            global_batch=GLOBAL_BATCH,
            scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5),
            run=RunConfig(run_dir=str(run_dir), seed=SEED, progress=False, tensorboard=False),
        )

    first = trainer(tmp_path / "first").fit(epochs=1)
    [end] = CheckpointStore(first.run_dir).paths()
    manifest = json.loads((end / "manifest.json").read_text())
    assert (manifest["epoch"], manifest["step"]) == (1, 0)
    manifest["epoch"], manifest["step"] = 0, 30  # the same global step: epoch 0 after its last (30th) step
    manifest[MANIFEST_SHA256] = _manifest_digest(manifest)  # (the manifest's own hash, as mixtrain would write it)
    (end / "manifest.json").write_text(json.dumps(manifest))
    resumed = trainer(tmp_path / "resumed").fit(epochs=2, resume=end)
    assert [r["epoch"] for r in run_records(resumed.run_dir, "eval")] == [0, 1]
    assert {r["epoch"] for r in resumed.history} == {1} and sum(r["num_steps"] for r in resumed.history) == 30


def test_resuming_mid_epoch_with_dropout_and_an_lr_schedule_continues_exactly(tmp_path):
    # A checkpoint after every round; resume from the one at epoch 0, step 12 (of 30) into another folder:
    # the workers' random streams (dropout) and the scheduler's position come back, so the resumed run ends
    # where the uninterrupted one did. Fixed shares: with dropout, which worker draws a sample's mask matters.
    from tests.models import dropout_task_with_schedule

    def run(run_dir, resume=None):
        x, y = data("mlp", NUM_SAMPLES)
        return Trainer(
            dropout_task_with_schedule,
            (x, y),
            global_batch=GLOBAL_BATCH,
            scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5, shares="equal"),
            run=RunConfig(
                run_dir=str(run_dir),
                seed=SEED,
                steps_per_round=4,
                progress=False,
                checkpoint_every_s=0,
                keep_checkpoints=100,
            ),
        ).fit(epochs=2, resume=resume)

    straight = run(tmp_path / "straight")
    mid = tmp_path / "straight" / "checkpoints" / "step-000000012"
    assert mid.is_dir()
    resumed = run(tmp_path / "resumed", resume=mid)
    assert (resumed.history[0]["epoch"], resumed.history[0]["first_step"]) == (0, 12)
    for name, want in straight.state_dict.items():
        assert torch.equal(resumed.state_dict[name], want), name
    # each round's recorded rate is the task's schedule's after the steps so far (no step skipped), bit for bit;
    # the resumed run's too
    schedule = dropout_task_with_schedule().scheduler
    assert schedule is not None
    rates = [schedule.get_last_lr()]
    for _ in range(2 * steps_per_epoch(NUM_SAMPLES, GLOBAL_BATCH)):
        schedule.optimizer.step()
        schedule.step()
        rates.append(schedule.get_last_lr())
    assert len({tuple(r) for r in rates}) > 5  # the schedule does change the rate
    for r in straight.history + resumed.history:
        done = r["epoch"] * steps_per_epoch(NUM_SAMPLES, GLOBAL_BATCH) + r["first_step"] + r["num_steps"]
        assert r["lr"] == rates[done], (done, r["lr"])
