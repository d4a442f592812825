"""Speed-aware shares: they follow measured speed, and the training math does not change."""

import functools
import os

import pytest

from mixtrain import RunConfig, ScalingConfig, Trainer
from tests.conftest import run_records
from tests.models import data, factory, paced_task
from tests.ray.test_exactness import GLOBAL_BATCH, NUM_SAMPLES, SEED, assert_same_weights, reference

pytestmark = pytest.mark.usefixtures("ray_session")


def fit(model, opt, scaling, x, y, tmp_path, steps_per_round=4):
    trainer = Trainer(
        factory(model, opt),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=scaling,
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=steps_per_round, progress=False),
    )
    return trainer.fit(epochs=1)


def test_shares_that_change_mid_run_still_match_single_process(tmp_path):
    x, y = data("cnn", NUM_SAMPLES)
    # worker 1 turns 3x slower from round 2: the shares change however well the probe saw the speeds (with
    # the slowdown on from the start a loaded machine once planned [49, 15] at once and never re-planned)
    scaling = ScalingConfig(num_workers=2, shares="auto", emulate_slowdown={1: (3.0, 2)}, leave_out_slow=False)
    result = fit("cnn", "adamw", scaling, x, y, tmp_path)
    shares_seen = {tuple(r["shares"]) for r in result.history}
    assert len(shares_seen) > 1, "the emulated slow worker should have triggered a re-plan"
    assert_same_weights(result.state_dict, reference("cnn", "adamw", x, y))


def test_micro_batches_with_accumulation_match_single_process(tmp_path):
    x, y = data("mlp", NUM_SAMPLES)
    scaling = ScalingConfig(num_workers=2, shares=[40, 24], max_micro_batch=[16, 5])
    result = fit("mlp", "sgd", scaling, x, y, tmp_path)
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_a_three_times_slower_worker_gets_the_share_that_balances_compute(tmp_path):
    from benchmarks.compare import make_data

    x, y = make_data("cnn")  # the benchmark CNN: compute-heavy enough that per-step fixed costs do not dominate
    trainer = Trainer(
        _cnn_task,
        (x[:1280], y[:1280]),
        global_batch=64,
        scaling=ScalingConfig(num_workers=2, emulate_slowdown={1: 3.0}, leave_out_slow=False),
        run=RunConfig(run_dir=str(tmp_path), steps_per_round=3, progress=False),
    )
    result = trainer.fit(epochs=1)
    shares = [r["shares"] for r in result.history]
    print("shares per round:", shares)
    # the start-up probe already sees the slow worker, so even the first round is below the half of an equal
    # split. The probe is one short timing per worker, which load moves either way: [52, 12], [41, 23] and,
    # beside a busy loop, [38, 26] were seen in a first round
    assert 4 <= shares[0][1] < 32, shares
    # The measured rounds then balance the two workers' compute per round, which with an equal split would
    # differ 3x. That is near a quarter only where per-step fixed costs are small: the emulation stretches them
    # 3x too, so the balanced share is 16 - k / 2t samples for a fixed cost of k per step and t per sample. Idle:
    # 13-14 of 64; beside another busy process 9-10 (a CI run once ended at [56, 8], below the quarter test's
    # 0.14 bound), with compute 0.21 s against 0.22 s, as balanced as idle
    ratios = sorted(max(c) / min(c) for c in ([w["compute_s"] for w in r["workers"]] for r in result.history[2:]))
    assert ratios[len(ratios) // 2] <= 1.6, (shares, ratios)
    assert 4 / 64 <= shares[-1][1] / 64 <= 0.34, shares


def test_a_slowdown_switched_on_mid_run_is_rebalanced_within_two_rounds(tmp_path):
    from benchmarks.compare import make_data

    x, y = make_data("cnn")
    trainer = Trainer(
        _cnn_task,
        (x[:1536], y[:1536]),
        global_batch=64,
        scaling=ScalingConfig(num_workers=2, emulate_slowdown={1: (3.0, 4)}, leave_out_slow=False),  # from round 4
        run=RunConfig(run_dir=str(tmp_path), steps_per_round=3, progress=False),
    )
    shares = [r["shares"][1] for r in trainer.fit(epochs=1).history]
    print("slow worker's share per round:", shares)
    # Equal speeds: about half until round 4 is measured. A round measured while another process holds a core
    # can read one of two equal workers 1.6x slower ([25, 25, 27, 29, 29] in a CI run), so the median counts
    equal = sorted(shares[:5])
    assert equal[2] >= 24 and equal[0] >= 16, shares
    # Round 4 is measured slow, so round 5 is re-planned; the fast worker's speed is smoothed over rounds, so
    # the slow share may land only near its mark at first ([.., 30, 19, 17, 15] in a CI run beside another
    # suite process, where 18 is 0.7 of the median): within two rounds it is there
    assert min(shares[5:7]) <= 0.7 * equal[2] and shares[-1] <= 22, shares


def _cnn_task():
    from benchmarks.compare import _mixtrain_task

    return _mixtrain_task("cnn")


def test_a_worker_that_slows_the_job_down_is_left_out_and_training_stays_exact(tmp_path):
    # Worker 1 of 3 is emulated 600000x slower than the others: even its minimum share of one sample takes
    # far longer than their whole step. The planner (default 30% gain) leaves it out at start, the gloo
    # group re-forms with the two others (renumbered 0 and 1), and the result is still single-process
    # training. Every sample costs every worker 2 ms asleep in its forward pass (the probe's too), so that
    # two workers clearly beat one (64 against 128 ms a step) whatever the load and the planner has no reason
    # to leave out a second. (It was all three emulated 200x slower: the emulation sleeps 199x the measured
    # compute, so one time slice lost to another process became a second of "compute", and a CI run on a
    # loaded machine left out a second worker mid-run.)
    x, y = data("mlp", NUM_SAMPLES)
    scaling = ScalingConfig(num_workers=3, cpus_per_worker=0.5, emulate_slowdown={1: 600000.0})
    trainer = Trainer(
        functools.partial(paced_task, "mlp", "sgd", 0.002),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=scaling,
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=4, progress=False),
    )
    result = trainer.fit(epochs=1)
    [pre] = run_records(result.run_dir, "preflight")
    assert [w["rank"] for w in pre["left_out"]] == [1], pre["left_out"]
    assert "faster without it" in pre["left_out"][0]["reason"]
    kinds = ("left_out", "readmitted", "failure")
    events = [(k, r.get("after_round"), r.get("reason")) for k in kinds for r in run_records(result.run_dir, k)]
    assert [w["rank"] for w in result.workers] == [0, 1], events
    assert all(len(r["shares"]) == 2 for r in result.history), ([r["shares"] for r in result.history], events)
    [first_plan] = [r for r in run_records(result.run_dir, "plan") if r["after_round"] == 0]
    assert len(first_plan["speeds"]) == 2 and first_plan["comm_s"] > 0
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_a_worker_that_turns_very_slow_mid_run_is_left_out_and_training_stays_exact(tmp_path):
    # Worker 1 of 3 turns 100x slower from round 2 (a laptop throttling hard): even one sample per step
    # (200 ms) holds the others up. Two measured rounds in a row find the job faster without it; between
    # rounds the other two re-form the group and go on. Every sample also takes 2 ms on every worker (a
    # sleep in the loss), so that two workers clearly beat one (64 against 128 ms a step) and no second worker
    # goes. (A fixed 20 ms per step, and later 0.5 ms per sample, 16 against 32 ms a step, made two workers
    # too little faster than one: on a loaded machine, where each step's exchange waited 20 ms and more for
    # a core, the wall clock rightly found one alone as fast, and a second worker was left out.)
    import functools

    from tests.models import faulty_task

    x, y = data("mlp", NUM_SAMPLES)
    task = functools.partial(
        faulty_task, "mlp", "sgd", "none", -1, 0, str(tmp_path / "unused"), sleep_per_sample_s=0.002
    )
    trainer = Trainer(
        task,
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=3, cpus_per_worker=0.5, emulate_slowdown={1: (100.0, 2)}),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=2, progress=False),
    )
    result = trainer.fit(epochs=1)
    widths = [len(r["shares"]) for r in result.history]
    print("workers per round:", widths)
    left_out = run_records(result.run_dir, "left_out")
    assert widths[:3] == [3, 3, 3] and widths[-1] == 2 and widths.index(2) <= 5, (widths, left_out)
    [gone] = left_out
    assert gone["worker"]["rank"] == 1 and "faster without it" in gone["reason"]
    assert len(result.workers) == 3  # the workers the run started with
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_keep_all_devices_keeps_the_slow_worker(tmp_path, monkeypatch):
    # Whether the plan names worker 1 depends on communication against the fast worker's compute: 30x slower
    # and the default 30% gain needed it to cost a third of a step, which a loaded machine (the whole suite on
    # 2 cores) did not always measure. 100x slower and a 1% gain need 2%: named whatever the load.
    monkeypatch.setenv("MIXTRAIN_EXCLUDE_GAIN", "0.01")
    x, y = data("mlp", 64 * 4)
    scaling = ScalingConfig(num_workers=2, emulate_slowdown={1: 100.0}, leave_out_slow=False)
    result = fit("mlp", "sgd", scaling, x, y, tmp_path)
    assert len(result.workers) == 2
    [first_plan] = [r for r in run_records(result.run_dir, "plan") if r["after_round"] == 0]
    assert list(first_plan["excluded"]) == ["1"]  # still named in the table as slowing the job down
    assert first_plan["shares"][1] < first_plan["shares"][0]
    assert all(len(r["shares"]) == 2 for r in result.history)  # kept in every round


def _paced_task(tmp_path, per_sample_s):
    """The mlp task with `per_sample_s` of compute per sample on every worker: two workers really are twice
    one (the compute is a sleep, so it holds on a loaded machine too)."""
    import functools

    from tests.models import faulty_task

    return functools.partial(faulty_task, "mlp", "sgd", "none", -1, 0, str(tmp_path / "unused"), 0.0, 0, per_sample_s)


def test_a_pair_measured_slower_than_the_fast_worker_alone_drops_the_slow_one_exactly(tmp_path, monkeypatch):
    # The model is told never to leave anyone out (a 100x gain required); worker 1 turns 100x slower from
    # round 2 (its 1 ms per sample becomes 100 ms). The wall clock shows the pair far below what worker 0
    # computes alone: worker 1 is left out at a round boundary on that measurement, the check confirms it, and
    # the math is one process's.
    monkeypatch.setenv("MIXTRAIN_EXCLUDE_GAIN", "100")
    x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        _paced_task(tmp_path, 0.001),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5, emulate_slowdown={1: (100.0, 2)}),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=2, progress=False),
    )
    result = trainer.fit(epochs=1)
    widths = [len(r["shares"]) for r in result.history]
    [gone] = run_records(result.run_dir, "left_out")
    assert gone["worker"]["rank"] == 1 and gone["reason"].startswith("measured"), gone["reason"]
    assert widths[:2] == [2, 2] and widths[-1] == 1 and not run_records(result.run_dir, "readmitted"), widths
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_a_leave_out_the_wall_clock_proves_wrong_is_taken_back_and_training_stays_exact(tmp_path, monkeypatch):
    # A margin of -95% makes the measured check leave out one of two equal, useful workers (the model is
    # told never to). Without it the job runs at about half the pair's samples/s, so two measured rounds
    # later it is taken back with the current state, and nobody is left out again for the cool-down; the
    # math never changes. 5 ms of compute per sample: a loaded machine added about 0.1 s to each of the pair's
    # steps (their exchange waits for both processes to get a core), which 1 ms per sample did not outweigh.
    from mixtrain.policies import decisions

    monkeypatch.setenv("MIXTRAIN_EXCLUDE_GAIN", "100")
    monkeypatch.setattr(decisions, "MEASURED_MARGIN", -0.95)
    x, y = data("mlp", NUM_SAMPLES)
    trainer = Trainer(
        _paced_task(tmp_path, 0.005),
        (x, y),
        global_batch=GLOBAL_BATCH,
        scaling=ScalingConfig(num_workers=2, cpus_per_worker=0.5),
        run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=2, progress=False),
    )
    result = trainer.fit(epochs=1)
    widths = [len(r["shares"]) for r in result.history]
    print("workers per round:", widths)
    [gone], [back] = run_records(result.run_dir, "left_out"), run_records(result.run_dir, "readmitted")
    assert gone["after_round"] < back["after_round"] and "taking it back" in back["reason"], (gone, back)
    assert widths[0] == 2 and 1 in widths and widths[-1] == 2, widths
    assert widths[widths.index(1) :].count(1) == back["after_round"] - gone["after_round"], widths
    assert_same_weights(result.state_dict, reference("mlp", "sgd", x, y))


def test_two_workers_on_a_busy_machine_leave_one_out_when_it_runs_faster_alone(tmp_path, monkeypatch):
    # Both workers may run on CPUs 0 and 1 only, and a busy loop holds CPU 1: each of the pair gets about half a
    # core and they wait on each other, so the pair runs at about half what one of them does alone (the speed
    # benchmark's MLP: 8,100 against 16,700 samples/s). The model is told never to leave anyone out, so the call
    # is a measured one: the busy-machine check's (the CPU share the pair's compute got says what one alone
    # would do) or, where waiting shows in the pair's own rate first, the plain one (which fires first depends
    # on the machine's other load; tests/unit/test_policies.py tests each). The wall clock then confirms or
    # takes it back, and the math is one process's either way.
    import functools
    import subprocess
    import sys

    import torch

    from mixtrain.data.sampling import epoch_permutation, steps_per_epoch
    from tests.models import wide_mlp_task

    if len(os.sched_getaffinity(0)) < 2 or not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("needs two CPUs and Linux schedstat")
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    monkeypatch.setenv("MIXTRAIN_EXCLUDE_GAIN", "100")
    batch, num_samples = 128, 128 * 120
    g = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(num_samples, 784, generator=g), torch.randint(0, 10, (num_samples,), generator=g)
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[1]}}})\nwhile 1: pass"])
    try:
        result = Trainer(
            functools.partial(wide_mlp_task, cores),
            (x, y),
            global_batch=batch,
            scaling=ScalingConfig(num_workers=2),
            run=RunConfig(run_dir=str(tmp_path), seed=SEED, steps_per_round=10, progress=False),
        ).fit(epochs=1)
    finally:
        hog.kill()
        hog.wait()
    widths = [len(r["shares"]) for r in result.history]
    shares = [w["cpu_share"] for r in result.history if len(r["shares"]) == 2 for w in r["workers"]]
    print("workers per round:", widths, "CPU shares in the pair:", shares)
    assert sum(shares) / len(shares) < 0.85, shares  # three busy threads on two cores: about 2/3 each
    assert all(w["cpu_wait_s"] > 0 for r in result.history if len(r["shares"]) == 2 for w in r["workers"])
    [gone] = run_records(result.run_dir, "left_out")
    assert gone["reason"].startswith("measured:"), gone["reason"]
    assert widths[0] == 2 and 1 in widths, widths
    assert run_records(result.run_dir, "leave_out_confirmed") or run_records(result.run_dir, "readmitted")
    task = wide_mlp_task()
    perm = torch.from_numpy(epoch_permutation(SEED, 0, num_samples))
    for step in range(steps_per_epoch(num_samples, batch)):
        idx = perm[step * batch : (step + 1) * batch]
        task.optimizer.zero_grad()
        task.loss_fn(task.model(x[idx]), y[idx]).backward()
        task.optimizer.step()
    assert_same_weights(result.state_dict, task.model.state_dict())
