"""Callbacks, max_steps, eval_every, EarlyStopping and the best checkpoint, on the controller without Ray (the fake
group of test_controller.py answers each round; its evaluations follow a script of losses). The real runs are in
tests/ray/test_callbacks_run.py."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from typing import Any

import pytest

from mixtrain import Callback, EarlyStopping, StopTraining
from mixtrain.callbacks import CheckpointSaved, Evaluated, RoundEnded, WorkersChanged
from mixtrain.checkpoint import CheckpointStore
from mixtrain.driver.hooks import Hooks, check_callbacks
from mixtrain.driver.states import Done, Finishing, Train
from mixtrain.errors import InputError, InputValueError
from mixtrain.group.port import RoundOutcome
from mixtrain.records.messages import RoundPlan
from tests.unit.test_controller import GLOBAL_BATCH, NUM_SAMPLES, FakeGroup, controller, report, steps_trained

STEPS = NUM_SAMPLES // GLOBAL_BATCH  # 8 steps per epoch


class Scripted(FakeGroup):
    """Held-out losses from a script (then the last one again)."""

    def __init__(self, losses: Sequence[float] = (0.5,)) -> None:
        super().__init__()
        self.losses = deque(losses)

    def evaluate(self, bounds, batches, timeout_s) -> list[dict[str, float]]:
        loss = self.losses.popleft() if len(self.losses) > 1 else self.losses[0]
        return [{"loss_sum": loss * (b - a), "samples": float(b - a)} for a, b in bounds]


class Recorder(Callback):
    """Keeps every event of every hook, in order (the real-run tests use it too)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def _keep(self, event: Any) -> None:
        self.events.append(event)

    on_run_start = on_round_end = on_eval_end = on_checkpoint = on_workers_changed = on_run_end = _keep

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def hooks(*callbacks: Callback) -> Hooks:
    return Hooks(callbacks, steps_per_epoch=STEPS, num_samples=NUM_SAMPLES, global_batch=GLOBAL_BATCH)


def test_each_hook_fires_once_per_round_evaluation_and_checkpoint_with_the_global_step(tmp_path):
    rec = Recorder()
    ctl, _ = controller(Scripted(), tmp_path, num_eval=10, hooks=hooks(rec))
    ctl.run(epochs=2)
    rounds = rec.of(RoundEnded)
    assert [r.global_step for r in rounds] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert rounds[-1].samples_seen == 2 * NUM_SAMPLES and rounds[0].shares == [4, 4] and rounds[0].loss == 1.0
    assert [(e.global_step, e.metrics["loss"]) for e in rec.of(Evaluated)] == [(8, 0.5), (16, 0.5)]
    assert [(c.epoch, c.step, c.global_step) for c in rec.of(CheckpointSaved)] == [(1, 0, 8), (2, 0, 16)]
    kinds = [type(e).__name__ for e in rec.events]  # the evaluation first, then the checkpoint that holds it
    assert kinds[kinds.index("Evaluated") + 1] == "CheckpointSaved"


def test_a_lost_worker_is_one_workers_changed_event_naming_it(tmp_path):
    group = Scripted()
    group.members.set_shares([4, 4])

    def worker_1_dies(plan: RoundPlan) -> RoundOutcome:
        return RoundOutcome({0: report(0, plan, committed_steps=1, peer_lost="peer died")}, {1: "it died"}, 0.1)

    group.rounds.append(worker_1_dies)
    rec = Recorder()
    ctl, _ = controller(group, tmp_path, hooks=hooks(rec))
    ctl.run(epochs=1)
    [lost] = rec.of(WorkersChanged)
    assert lost.kind == "lost" and lost.reason == "it died" and lost.workers[0]["rank"] == 1
    assert steps_trained(group)[-1] == (0, 7)


def test_a_callback_that_raises_is_reported_once_and_training_goes_on(tmp_path):
    class Broken(Callback):
        calls = 0

        def on_round_end(self, event: RoundEnded) -> None:
            self.calls += 1
            raise RuntimeError("the logger's server is down")

    broken, rec = Broken(), Recorder()
    group = Scripted()
    ctl, log = controller(group, tmp_path, hooks=hooks(broken, rec))
    ctl.run(epochs=1)
    assert broken.calls == 4 and len(rec.of(RoundEnded)) == 4  # the next callback still hears every round
    [error] = log.kinds("callback_error")
    assert error["callback"] == "Broken" and error["hook"] == "on_round_end" and "server is down" in error["error"]
    assert steps_trained(group) == [(0, s) for s in range(STEPS)]


def test_stop_training_ends_at_the_round_boundary_with_an_evaluation_and_a_checkpoint(tmp_path):
    class StopAt6(Callback):
        def on_round_end(self, event: RoundEnded) -> None:
            if event.global_step == 6:
                raise StopTraining("enough")

    group = Scripted()
    ctl, log = controller(group, tmp_path, num_eval=10, hooks=hooks(StopAt6()))
    ctl.run(epochs=3)
    assert steps_trained(group) == [(0, s) for s in range(6)]
    assert ctl.stopped_early == "StopAt6: enough"
    assert [e["global_step"] for e in ctl.evals] == [6]
    assert [(c["epoch"], c["step"]) for c in log.kinds("checkpoint")] == [(0, 6)]
    assert log.kinds("stopped_early")[0]["reason"] == "StopAt6: enough"


def test_max_steps_ends_inside_an_epoch_with_exactly_those_steps(tmp_path):
    group = Scripted()
    ctl, log = controller(group, tmp_path, num_eval=10, max_steps=11)
    ctl.run(epochs=2)
    assert steps_trained(group) == [(0, s) for s in range(STEPS)] + [(1, 0), (1, 1), (1, 2)]
    assert [e["global_step"] for e in ctl.evals] == [8, 11]
    assert [(c["epoch"], c["step"]) for c in log.kinds("checkpoint")] == [(1, 0), (1, 3)]
    assert ctl.stopped_early is None  # max_steps is the run's length, not a stop
    assert ctl.step(Train(1, 3)) == Finishing(1, 3) and ctl.step(Finishing(1, 3)) == Done()


def test_eval_every_evaluates_on_those_global_steps_and_at_the_end(tmp_path):
    group = Scripted()
    ctl, log = controller(group, tmp_path, num_eval=10, eval_every=3, steps_per_round=4)
    ctl.run(epochs=2)
    assert [e["global_step"] for e in ctl.evals] == [3, 6, 9, 12, 15, 16]
    assert all(p.first_step + p.num_steps <= STEPS for p in group.plans)  # rounds cut at evaluations
    assert len(steps_trained(group)) == 2 * STEPS == len(set(steps_trained(group)))
    assert [c["global_step"] for c in log.kinds("checkpoint")] == [3, 6, 9, 12, 15, 16]  # none at step 8


def test_the_best_checkpoint_survives_pruning_and_is_named(tmp_path):
    group = Scripted([0.9, 0.4, 0.7, 0.8, 0.6, 0.5])
    ctl, _ = controller(group, tmp_path, num_eval=10, eval_every=2, keep_best=("loss", "min"))
    ctl.checkpoints.store = CheckpointStore(tmp_path, keep=2)
    ctl.run(epochs=1, start=(0, 0))
    assert [e["loss"] for e in ctl.evals] == pytest.approx([0.9, 0.4, 0.7, 0.8])
    assert ctl.best_checkpoint == tmp_path / "checkpoints" / "step-000000004"
    names = sorted(p.name for p in CheckpointStore(tmp_path).paths())
    assert names == ["step-000000004", "step-000000006", "step-000000008"]  # the best beside the 2 newest
    best = json.loads(ctl.checkpointer.driver_state())["best"]
    assert best == {"metric": "loss", "mode": "min", "value": 0.4, "name": names[0]}
    saved = json.loads(CheckpointStore.read(ctl.best_checkpoint)[0]["driver"])["best"]
    assert saved["name"] == names[0]  # the best checkpoint says it is the best: a resume from it keeps it


def test_a_best_checkpoint_that_could_not_be_written_leaves_the_previous_best_kept(tmp_path, monkeypatch):
    group = Scripted([0.9, 0.4, 0.3])
    ctl, log = controller(group, tmp_path, num_eval=10, eval_every=2, keep_best=("loss", "min"), max_steps=6)
    ctl.checkpoints.store = store = CheckpointStore(tmp_path, keep=1)
    real_save, calls = store.save, []

    def save(state, meta):  # the third checkpoint (step 6, the new best) finds the disk full, twice
        calls.append(meta["global_step"])
        if meta["global_step"] == 6:
            raise OSError(28, "No space left on device")
        return real_save(state, meta)

    monkeypatch.setattr(store, "save", save)
    ctl.run(epochs=1)
    assert [e["global_step"] for e in ctl.evals] == [2, 4, 6]
    assert calls == [2, 4, 6, 6, 6, 6]  # tried after the evaluation and again at the run's end, each twice
    assert ctl.best_checkpoint == tmp_path / "checkpoints" / "step-000000004" and store.keep_also == {"step-000000004"}
    assert log.kinds("checkpoint_failed")


def test_early_stopping_counts_on_after_a_resume(tmp_path):
    """Patience 3 over losses 0.9, 0.5, 0.6, 0.7 | resume | 0.8: the third evaluation without improvement
    stops the resumed run (a fresh count would have gone on)."""
    first = EarlyStopping("loss", patience=3)
    group = Scripted([0.9, 0.5, 0.6, 0.7])
    ctl, _ = controller(group, tmp_path, num_eval=10, eval_every=2, hooks=hooks(first))
    ctl.run(epochs=1)
    assert (first.best, first.bad_evals) == (0.5, 2) and ctl.stopped_early is None
    assert "driver" not in ctl.checkpoints.read_last()[0]  # a rewind hands the workers their state only
    saved = CheckpointStore.read(ctl.last_checkpoint)[0]["driver"]

    again = EarlyStopping("loss", patience=3)
    group2 = Scripted([0.8])
    ctl2, _ = controller(group2, tmp_path, num_eval=10, eval_every=2, hooks=hooks(again))
    ctl2.load_driver_state(saved)
    assert (again.best, again.bad_evals) == (0.5, 2)
    ctl2.run(epochs=2, start=(1, 0))
    assert [e["global_step"] for e in ctl2.evals] == [10] and steps_trained(group2) == [(1, 0), (1, 1)]
    assert ctl2.stopped_early is not None and "not improved on 0.5 for 3 evaluations" in ctl2.stopped_early


def test_a_checkpoint_whose_driver_state_was_tampered_with_cannot_point_the_best_elsewhere(tmp_path):
    ctl, _ = controller(Scripted(), tmp_path, num_eval=10, keep_best=("loss", "min"), hooks=hooks(EarlyStopping()))
    for saved in (
        json.dumps({"best": {"metric": "loss", "mode": "min", "value": 0.1, "name": "../../etc"}}),
        json.dumps({"best": {"metric": "loss", "mode": "min", "value": "x", "name": "step-000000001"}}),
        json.dumps({"callbacks": json.dumps([{"callback": "EarlyStopping", "state": {"bad_evals": -4}}])}),
        json.dumps({"callbacks": "{not json"}),
        "[1, 2]",
        "{",
        None,
    ):
        ctl.load_driver_state(saved)
        assert ctl.checkpoints.best is not None and ctl.checkpoints.best.name is None and ctl.checkpoints.store
        assert ctl.checkpoints.store.keep_also == set()
        assert ctl.hooks.callbacks[0].bad_evals == 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("setting", ["early_stopping", "keep_best"])
def test_a_metric_that_is_not_there_stops_the_run_at_that_evaluation_naming_the_ones_there_are(tmp_path, setting):
    """Issue 46: EarlyStopping on a metric the evaluation lacks was a note and the run went on, never stopping;
    --keep-best stopped with a resume hint that stopped again the same way. Both stop there now, a checkpoint
    holding the training, and say to name one of the metrics there are."""
    group = Scripted()
    more = {"keep_best": ("acc", "max")} if setting == "keep_best" else {"hooks": hooks(EarlyStopping("acc"))}
    ctl, log = controller(group, tmp_path, num_eval=10, **more)
    field = "RunConfig.keep_best" if setting == "keep_best" else "EarlyStopping.metric"
    with pytest.raises(InputValueError, match=rf"{field}='acc'.*it has \['loss'\].*stopped at that evaluation") as e:
        ctl.run(epochs=3)
    assert "naming one of those metrics" in str(e.value) and "continue with" not in str(e.value)
    assert [c["global_step"] for c in log.kinds("checkpoint")] == [8] and not log.kinds("callback_error")
    assert steps_trained(group)[-1] == (0, 7)  # nothing trained past the first evaluation


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ("EarlyStopping", "a class: give an instance"),
        (print, "callbacks=<built-in function print>"),
        ([EarlyStopping(), 3], r"callbacks\[1\]=3"),
    ],
)
def test_callbacks_that_are_not_callbacks_are_refused_by_name(given, match):
    given = EarlyStopping if given == "EarlyStopping" else given
    with pytest.raises(InputError, match=match):
        check_callbacks([given] if given is EarlyStopping else given)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"patience": 0}, "patience"), ({"mode": "up"}, "mode"), ({"min_delta": -1}, "min_delta"), ({"metric": ""}, "")],
)
def test_early_stopping_settings_are_checked_by_name(kwargs, field):
    with pytest.raises(InputError, match=f"EarlyStopping.{field}"):
        EarlyStopping(**kwargs)


def test_a_nul_byte_metric_is_refused_naming_its_flag():
    # found by tests/unit/test_input_properties.py: "\x00" passed the flag's own check and EarlyStopping then
    # refused it without naming --early-stopping
    import argparse

    from mixtrain.cli.main import _early_stopping, _keep_best

    for parse, flag in ((_early_stopping, "--early-stopping"), (_keep_best, "--keep-best")):
        with pytest.raises(argparse.ArgumentTypeError, match=flag):
            parse("\x00:min")
