"""The controller, one transition at a time, without Ray: a fake worker group answers each round from a script, and
the policies' decisions are scripted too. Each test runs in well under a second (issue 34)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from mixtrain import ScalingConfig
from mixtrain.checkpoint import CheckpointStore
from mixtrain.cluster.placement import WorkerSpec
from mixtrain.driver.changes import TrainingStopped
from mixtrain.driver.controller import Controller, Policies
from mixtrain.driver.hooks import Hooks
from mixtrain.driver.interrupt import TrainingInterrupted
from mixtrain.driver.states import Done, EpochEnd, RoundDone, RoundFailed, Stopping, Train
from mixtrain.group.membership import Member, Membership, Status
from mixtrain.group.port import Joined, RoundOutcome, WorkersLost
from mixtrain.observe.progress import ProgressView
from mixtrain.policies.decisions import Adopt, Decision, FailureBudget, LeaveOut, NonFiniteStreak, Noop, Rebalancer
from mixtrain.policies.planner import make_plan
from mixtrain.records.messages import RoundPlan, WorkerInfo, WorkerReport
from mixtrain.records.run_state import RunSettings
from mixtrain.records.tunables import Tunables

GLOBAL_BATCH = 8
NUM_SAMPLES = 64  # 8 steps per epoch


def member(rank: int, bundle: int | None = None) -> Member:
    """The worker at `rank`, started in `bundle` (its first rank; `rank` where None)."""
    bundle = rank if bundle is None else bundle
    spec = WorkerSpec(rank=bundle, device="cpu", bundle={"CPU": 1.0}, label_selector={}, threads=1, precision="fp32")
    info = WorkerInfo(
        rank=rank,
        host="10.0.0.1",
        hostname="box",
        pid=100 + bundle,
        node_id="n",
        device="cpu",
        device_name=f"cpu {bundle}",
        precision="fp32",
        threads=1,
    )
    return Member(worker=None, spec=spec, info=info, speed=100.0)


def report(rank: int, plan: RoundPlan, **fields: Any) -> WorkerReport:
    n = plan.num_steps
    out = WorkerReport(
        rank=rank,
        samples=plan.shares[rank] * n,
        compute_s=[0.01] * n,
        comm_s=[0.001] * n,
        losses=[1.0] * n,
        committed_steps=n,
    )
    for key, value in fields.items():
        setattr(out, key, value)
    return out


class FakeGroup:
    """The GroupPort of group/port.py, in memory. `rounds` scripts the rounds: each entry makes one round's outcome
    from its plan (the default: every worker reports every step, in `wall_s` seconds)."""

    def __init__(self, num_workers: int = 2) -> None:
        self.members = Membership([member(r) for r in range(num_workers)])
        self.members.set_shares([GLOBAL_BATCH // num_workers] * num_workers)
        self.scaling = ScalingConfig(num_workers=num_workers)
        self.shards_optimizer = False
        self.rounds: deque[Callable[[RoundPlan], RoundOutcome]] = deque()
        self.plans: list[RoundPlan] = []
        self.calls: list[tuple[str, Any]] = []
        self.joining: deque[Joined] = deque()
        self.lose_in_state: dict[int, str] | None = None
        self.wall_s = 0.1
        self.form_s = 0.0

    def run_round(self, plan: RoundPlan) -> RoundOutcome:
        self.plans.append(plan)
        if self.rounds:
            return self.rounds.popleft()(plan)
        return RoundOutcome({r: report(r, plan) for r in range(len(self.members))}, {}, self.wall_s)

    def leave_out(self, ranks: Sequence[int], *, recover=None, lost=False, restore=None, park=False) -> None:
        self.calls.append(("leave_out", {"ranks": list(ranks), "recover": recover, "lost": lost, "park": park}))
        if park:
            self.members.park(ranks[0])
        elif ranks:
            self.members.leave(ranks, lost=lost)

    def readmit(self) -> Member:
        self.calls.append(("readmit", None))
        return self.members.take_back()

    def release_parked(self) -> None:
        self.calls.append(("release_parked", None))
        self.members.release_parked(keep_spare=False)

    def start_replacements(self) -> None:
        self.calls.append(("start_replacements", None))

    def admit(self, global_batch: int) -> Joined:
        joined = self.joining.popleft() if self.joining else Joined([], [])
        for m in joined.members:
            self.members.add(m)
        return joined

    def full_state(self) -> dict[str, Any]:
        if self.lose_in_state is not None:
            lost, self.lose_in_state = self.lose_in_state, None
            raise WorkersLost(lost)
        return {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}}}

    def rank_states(self) -> list[dict[str, Any]]:
        return []

    def rng_states(self) -> list[dict[str, Any]]:
        return [{"cpu": torch.get_rng_state()} for _ in self.members]

    def evaluate(
        self, bounds: Sequence[tuple[int, int]], batches: Sequence[int], timeout_s: float
    ) -> list[dict[str, float]]:
        return [{"loss_sum": 0.5 * (b - a), "samples": float(b - a)} for a, b in bounds]


class Log:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []

    def write(self, kind: str, record: dict[str, Any]) -> None:
        self.records.append((kind, record))

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [r for k, r in self.records if k == kind]


class ScriptedRebalancer(Rebalancer):
    """The rebalancer's verdicts from a script (Noop once it runs out)."""

    def __init__(self, decisions: Sequence[Decision] = ()) -> None:
        super().__init__(global_batch=GLOBAL_BATCH, leave_out_slow=True, threshold=0.1, min_gain=0.3)
        self.script = deque(decisions)

    def decide(self, **measured: Any) -> Decision:
        return self.script.popleft() if self.script else Noop()


class Stop:
    def __init__(self) -> None:
        self.requested = False


def controller(
    group: FakeGroup,
    tmp_path,
    *,
    decisions: Sequence[Decision] = (),
    num_eval: int = 0,
    max_failures: int = 3,
    steps_per_round: int | None = 2,
    stop: Stop | None = None,
    hooks: Hooks | None = None,
    **more: Any,
) -> tuple[Controller, Log]:
    """A controller over `group` with a fake log; `more`: other RunSettings (max_steps, eval_every, keep_best)."""
    settings = RunSettings(
        **more,
        num_samples=NUM_SAMPLES,
        global_batch=GLOBAL_BATCH,
        steps_per_round=steps_per_round,
        drift_tolerance=1e-6,
        num_eval=num_eval,
        balanced=True,
        leave_out_slow=True,
        checkpoint_every_s=1e9,
        max_failures=max_failures,
    )
    policies = Policies(ScriptedRebalancer(decisions), FailureBudget(max_failures), NonFiniteStreak(10))
    log = Log()
    return (
        Controller(
            group,  # type: ignore[arg-type]
            settings,
            Tunables(),
            policies,
            log=log,  # type: ignore[arg-type]
            view=ProgressView(False, 0),
            checkpoints=CheckpointStore(tmp_path),
            stop=stop,  # type: ignore[arg-type]
            hooks=hooks,
        ),
        log,
    )


def steps_trained(group: FakeGroup) -> list[tuple[int, int]]:
    return [(p.epoch, s) for p in group.plans for s in range(p.first_step, p.first_step + p.num_steps)]


def test_a_run_trains_every_step_once_checkpoints_and_evaluates_each_epoch(tmp_path):
    group = FakeGroup()
    ctl, log = controller(group, tmp_path, num_eval=10)
    ctl.run(epochs=2)
    assert steps_trained(group) == [(e, s) for e in range(2) for s in range(8)]
    assert [p.round_index for p in group.plans] == list(range(len(group.plans)))
    assert [e["loss"] for e in ctl.evals] == [0.5, 0.5] and len(log.kinds("eval")) == 2
    assert [(c["epoch"], c["step"]) for c in log.kinds("checkpoint")] == [(1, 0), (2, 0)]  # before each evaluation
    assert ctl.last_checkpoint is not None and CheckpointStore.verify(ctl.last_checkpoint)


def test_every_epochs_line_is_shown_without_held_out_data_also_where_a_checkpoint_is_written(tmp_path):
    group = FakeGroup()
    ctl, log = controller(group, tmp_path)
    shown: list[str] = []
    ctl.view.log = shown.append  # type: ignore[method-assign]
    ctl.run(epochs=2)
    assert [(c["epoch"], c["step"]) for c in log.kinds("checkpoint")] == [(2, 0)]  # the last epoch's end
    assert [line.split(":")[0] for line in shown if line.startswith("epoch ")] == ["epoch 1/2", "epoch 2/2"], shown


def test_transitions_one_at_a_time(tmp_path):
    group = FakeGroup()
    ctl, _ = controller(group, tmp_path)
    ctl.epochs = 1
    done = ctl.step(Train(0, 0))
    assert isinstance(done, RoundDone) and done.plan.shares == (4, 4) and done.plan.num_steps == 2
    assert ctl.step(done) == Train(0, 2)
    assert ctl.step(Train(0, 8)) == EpochEnd(0)
    assert ctl.step(EpochEnd(0)) == Done()


def test_a_worker_lost_mid_round_costs_only_the_steps_no_survivor_committed(tmp_path):
    group = FakeGroup(3)
    group.members.set_shares([3, 3, 2])

    def worker_2_dies(plan: RoundPlan) -> RoundOutcome:
        reports = {r: report(r, plan, committed_steps=1, peer_lost="peer died") for r in (0, 1)}
        reports[0].committed_steps = 2  # rank 0 saw one step more: rank 1 takes its state
        return RoundOutcome(reports, {2: "its process died"}, 0.1)

    group.rounds.append(worker_2_dies)
    ctl, log = controller(group, tmp_path)
    ctl.epochs = 1
    failed = ctl.step(Train(0, 0))
    assert isinstance(failed, RoundFailed)
    assert ctl.step(failed) == Train(0, 2)  # both committed steps stand
    [call] = [c for name, c in group.calls if name == "leave_out"]
    assert call == {"ranks": [2], "recover": {0: 2, 1: 1}, "lost": True, "park": False}
    assert ("start_replacements", None) in group.calls
    assert len(group.members) == 2 and sum(group.members.shares()) == GLOBAL_BATCH
    assert group.members.vacant == [group.members.with_status(Status.GONE)[0].spec]
    [failure] = log.kinds("failure")
    assert failure["failures"] == 1 and failure["step"] == 2
    ctl.run(epochs=1, start=(0, 2))
    assert steps_trained(group)[2:] == [(0, s) for s in range(2, 8)]


def test_the_failure_budget_spent_stops_with_the_resume_hint(tmp_path):
    group = FakeGroup(2)
    group.rounds.append(lambda plan: RoundOutcome({0: report(0, plan, committed_steps=0)}, {1: "died"}, 0.1))
    ctl, _ = controller(group, tmp_path, max_failures=0)
    with pytest.raises(TrainingStopped, match=r"training stopped at epoch 0, step 0: 1 failures within 60 minutes"):
        ctl.run(epochs=1)


def test_leave_out_by_measurement_then_take_back_when_the_wall_clock_disagrees(tmp_path):
    group = FakeGroup(2)
    ctl, log = controller(group, tmp_path, decisions=[Noop(), LeaveOut(1, "slows the job down")])
    ctl.epochs = 3
    state: Any = Train(0, 0)
    for _ in range(6):  # three rounds: warm-up, a measured one, the one that leaves worker 1 out
        state = ctl.step(state)
    assert len(group.members) == 1 and group.members.parked is not None
    assert [c for name, c in group.calls if name == "leave_out"][-1]["park"] is True
    assert group.members.shares() == [GLOBAL_BATCH]
    group.wall_s = 1.0  # alone, the job runs 10x slower than the pair did: LeaveOutCheck takes it back
    for _ in range(12):  # a warm-up round and two measured ones without it (and an epoch's end between)
        state = ctl.step(state)
        if ("readmit", None) in group.calls:
            break
    assert ("readmit", None) in group.calls and len(group.members) == 2
    [readmitted] = log.kinds("readmitted")
    assert "taking it back" in readmitted["reason"] and ctl.policies.rebalancer.hold_rounds > 0
    assert sum(group.members.shares()) == GLOBAL_BATCH


def test_a_leave_out_the_wall_clock_confirms_frees_the_worker(tmp_path):
    group = FakeGroup(2)
    ctl, log = controller(group, tmp_path, decisions=[Noop(), LeaveOut(1, "slows the job down")])
    group.wall_s = 0.1
    ctl.run(epochs=3)
    assert ("release_parked", None) in group.calls and group.members.parked is None
    assert len(log.kinds("leave_out_confirmed")) == 1 and len(group.members) == 1


def test_out_of_memory_halves_that_workers_micro_batch_and_goes_on(tmp_path):
    group = FakeGroup(2)

    def rank_1_oom(plan: RoundPlan) -> RoundOutcome:
        reports = {0: report(0, plan, committed_steps=1, peer_lost="closed"), 1: report(1, plan, committed_steps=1)}
        reports[1].peer_lost, reports[1].out_of_memory = "CUDA out of memory", True
        return RoundOutcome(reports, {}, 0.1)

    group.rounds.append(rank_1_oom)
    ctl, log = controller(group, tmp_path)
    ctl.epochs = 1
    assert ctl.step(ctl.step(Train(0, 0))) == Train(0, 1)
    assert group.members[1].memory_cap == 2 and len(group.members) == 2  # its share was 4: micro-batch 2 now
    assert [c for name, c in group.calls if name == "leave_out"] == [
        {"ranks": [], "recover": {0: 1, 1: 1}, "lost": False, "park": False}
    ]
    assert not log.kinds("failure") and log.kinds("out_of_memory")[0]["memory_caps"] == [None, 2]
    assert ctl.step(Train(0, 1)).plan.micro_batches == (4, 2)  # type: ignore[union-attr]


def test_a_replacement_joins_and_one_that_died_while_joining_is_only_a_note(tmp_path):
    group = FakeGroup(2)
    group.rounds.append(lambda plan: RoundOutcome({0: report(0, plan, committed_steps=0)}, {1: "died"}, 0.1))
    newcomer = member(1)
    group.joining.append(Joined([], ["a replacement on 10.0.0.2 was dropped while it joined (actor died)"]))
    group.joining.append(Joined([newcomer], []))
    ctl, log = controller(group, tmp_path)
    ctl.run(epochs=1)
    assert len(log.kinds("failure")) == 1 and [r["worker"] for r in log.kinds("rejoined")] == [newcomer.info]
    assert len(group.members) == 2 and sum(group.members.shares()) == GLOBAL_BATCH
    assert steps_trained(group)[2:] == [(0, s) for s in range(8)]  # the lost round (steps 0-1) redone whole


def test_ctrl_c_checkpoints_where_it_stopped_and_raises_with_the_resume_command(tmp_path):
    group, stop = FakeGroup(2), Stop()
    ctl, log = controller(group, tmp_path, stop=stop)
    ctl.epochs = 1
    assert isinstance(ctl.step(Train(0, 0)), RoundDone)
    stop.requested = True
    assert ctl.step(Train(0, 2)) == Stopping(0, 2)
    with pytest.raises(TrainingInterrupted, match=r"stopped at epoch 0, step 2\. .*mixtrain train --resume") as err:
        ctl.step(Stopping(0, 2))
    assert err.value.checkpoint == ctl.last_checkpoint and log.kinds("checkpoint")[0]["step"] == 2


def test_a_worker_lost_while_checkpointing_is_recovered_and_the_checkpoint_written(tmp_path):
    group = FakeGroup(3)
    group.members.set_shares([3, 3, 2])
    group.lose_in_state = {2: "did not answer checkpoint() in time"}
    ctl, log = controller(group, tmp_path)
    ctl.epochs = 1
    assert ctl.step(EpochEnd(0)) == Done()  # the last epoch's end writes one
    assert len(group.members) == 2 and len(log.kinds("failure")) == 1
    assert [(c["epoch"], c["step"], c["num_workers"]) for c in log.kinds("checkpoint")] == [(1, 0, 2)]


def test_a_rebalance_adopts_the_scripted_plan(tmp_path):
    group = FakeGroup(2)
    plan = make_plan([300.0, 100.0], GLOBAL_BATCH)
    ctl, log = controller(group, tmp_path, decisions=[Adopt(plan)])
    ctl.epochs = 1
    state: Any = Train(0, 0)
    for _ in range(4):
        state = ctl.step(state)
    assert group.members.shares() == plan.shares == [6, 2]
    assert log.kinds("plan")[-1]["shares"] == [6, 2]


class AllNaN(FakeGroup):
    """Every step's loss is NaN on every worker: each step is skipped (issue 46: 8 such steps ended "done")."""

    def run_round(self, plan: RoundPlan) -> RoundOutcome:
        self.plans.append(plan)
        steps = list(range(plan.first_step, plan.first_step + plan.num_steps))
        reports = {
            r: report(r, plan, losses=[math.nan] * plan.num_steps, skipped_steps=steps, nonfinite_steps=steps)
            for r in range(len(self.members))
        }
        return RoundOutcome(reports, {}, self.wall_s)


def test_a_run_that_applied_no_step_fails_naming_the_cause_instead_of_ending_done(tmp_path):
    from mixtrain.driver.changes import TrainingStopped

    group = AllNaN()
    ctl, log = controller(group, tmp_path, max_nonfinite_steps=10)  # 8 steps: fewer than the limit in a row
    with pytest.raises(TrainingStopped, match=r"no step of this run was applied: all 8 had a NaN or Inf gradient"):
        ctl.run(epochs=1)
    assert "worker 0" in log.kinds("untrained")[0]["reason"] and len(steps_trained(group)) == 8
    ctl, _ = controller(FakeGroup(), tmp_path / "b", max_nonfinite_steps=10)
    ctl.run(epochs=1)  # steps applied: done as before
    ctl, _ = controller(FakeGroup(), tmp_path / "c", max_nonfinite_steps=10)
    ctl.run(epochs=1, start=(1, 0))  # nothing left to run (a finished run resumed): not a failure either
