import pytest

from mixtrain.policies.planner import equal_shares, largest_remainder, resolve_shares, shares_for_step


@pytest.mark.parametrize(
    "weights,total", [([1, 1, 1], 64), ([3, 1], 64), ([0.3, 0.2, 0.5], 7), ([5, 0, 1], 13), ([1], 0)]
)
def test_largest_remainder_sums_to_total(weights, total):
    out = largest_remainder(weights, total)
    assert sum(out) == total
    assert all(o >= 0 for o in out)
    exact = [w * total / sum(weights) for w in weights]
    assert all(abs(o - e) < 1 for o, e in zip(out, exact))


def test_largest_remainder_proportional_and_deterministic_ties():
    assert largest_remainder([3, 1], 64) == [48, 16]
    assert largest_remainder([1, 1, 1], 64) == [22, 21, 21]
    assert equal_shares(64, 3) == [22, 21, 21]


def test_largest_remainder_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        largest_remainder([0, 0], 5)
    with pytest.raises(ValueError, match="weights"):
        largest_remainder([], 5)


def test_resolve_shares_checks_user_values():
    assert resolve_shares(None, 64, 2) == [32, 32]
    assert resolve_shares([40, 24], 64, 2) == [40, 24]
    with pytest.raises(ValueError, match=r"shares=\[40, 20\] sum to 60 but global_batch=64"):
        resolve_shares([40, 20], 64, 2)
    with pytest.raises(ValueError, match="global_batch=2 is smaller than num_workers=3"):
        resolve_shares(None, 2, 3)


def test_partial_step_scales_shares():
    assert shares_for_step([40, 24], 64) == [40, 24]
    assert shares_for_step([40, 24], 16) == [10, 6]
    assert sum(shares_for_step([30, 20, 14], 5)) == 5


def test_balanced_shares_follow_speed_and_keep_everyone_measured():
    from mixtrain.policies.planner import balanced_shares

    assert balanced_shares([3000, 1000], 64) == [48, 16]
    assert sum(balanced_shares([5.0, 3.0, 1.0], 97)) == 97
    assert balanced_shares([1e6, 1.0], 64)[1] == 1  # never 0: a worker at 0 could not be measured again


def test_plan_splits_shares_over_memory_caps_into_accumulation():
    from mixtrain.policies.planner import make_plan

    plan = make_plan([3000, 1000], 64, memory_caps=[None, 5])
    assert plan.shares == [48, 16]
    assert plan.micro_batches == [48, 5] and plan.accumulation == [1, 4]
    assert abs(plan.predicted_step_s - 0.016) < 1e-12 and abs(plan.predicted_samples_per_s - 4000) < 1e-6
    fixed = make_plan([3000, 1000], 64, shares=[32, 32])
    assert fixed.shares == [32, 32] and abs(fixed.predicted_step_s - 0.032) < 1e-12


def test_plan_marks_a_device_that_slows_the_job_down():
    from mixtrain.policies.planner import make_plan

    # alone: 128 / 20000 = 6.4 ms; together: shares [121, 7], the slow one takes 7 ms, + 10 ms = 17 ms
    plan = make_plan([20000, 1000], 128, comm_s=0.010, min_gain=0.3)
    assert list(plan.excluded) == [1] and "communication costs more" in plan.excluded[1]
    assert "2.7x faster without it (6.4 ms per step instead of 17.0 ms" in plan.excluded[1]
    assert make_plan([3000, 1000], 64, comm_s=0.001, min_gain=0.3).excluded == {}
    assert make_plan([20000, 1000], 128, comm_s=0.010).excluded == {}  # no min_gain: no judgement


def test_exclusion_needs_the_margin_and_prefers_the_slowest():
    from mixtrain.policies.planner import exclusion, make_plan

    # two equal workers, communication as long as half the compute: alone 6.4 ms vs 3.2 + 3.2 ms, no gain
    assert make_plan([20000, 20000], 128, comm_s=0.0032, min_gain=0.3).excluded == {}
    # three workers: comm stays with two left, so only a device that adds little is left out
    speeds = [10000.0, 10000.0, 300.0]
    plan = make_plan(speeds, 128, comm_s=0.001, min_gain=0.0)
    assert plan.shares == [63, 62, 3]
    found = exclusion(speeds, 128, 0.001, step_s=0.050, min_gain=0.3)
    assert found is not None and found[0] == 2 and "adds less than it costs" in found[1]
    assert exclusion([5000.0], 128, 0.01, 0.1, 0.3) is None  # never the last worker


def test_step_time_has_no_communication_for_one_worker():
    from mixtrain.policies.planner import step_seconds

    assert step_seconds([64], [6400.0], comm_s=0.5) == 0.01
    assert abs(step_seconds([32, 32], [6400.0, 3200.0], comm_s=0.5) - 0.51) < 1e-12


def test_plan_table_shows_every_column_and_who_was_left_out():
    from mixtrain.observe.progress import plan_table
    from mixtrain.policies.planner import make_plan
    from mixtrain.records.messages import LeftOut, WorkerInfo

    def info(rank, host, name):
        return WorkerInfo(
            rank=rank,
            host=host,
            hostname="",
            pid=1,
            node_id="",
            device="cpu",
            device_name=name,
            precision="fp32",
            threads=1,
        )

    plan = make_plan([3000, 1000], 64, memory_caps=[None, 5], comm_s=0.004)
    workers = [info(r, "10.0.0.2", name) for r, name in enumerate(["NVIDIA RTX 4090", "Apple M2 (MPS)"])]
    gone = [LeftOut(info(2, "10.0.0.3", "Intel i5"), "too slow")]
    text = plan_table(plan, workers, "plan", gone)
    rows = text.splitlines()
    assert "share  micro x acc  compute/s  predicted/s  memory cap" in rows[1]
    assert "NVIDIA RTX 4090" in rows[2] and "48 x 1" in rows[2] and "no limit" in rows[2]
    assert "Apple M2 (MPS)" in rows[3] and "5 x 4" in rows[3] and rows[3].rstrip().endswith("5")
    assert "left out: worker 2 (Intel i5 on 10.0.0.3): too slow" in text
    assert "predicted: 3,200 samples/s, 20.0 ms per step (16.0 ms compute + 4.0 ms communication)" in text


def test_rebalance_only_past_the_threshold():
    from mixtrain.policies.planner import needs_rebalance

    assert not needs_rebalance([0.100, 0.105], 0.10)
    assert needs_rebalance([0.100, 0.300], 0.10)
    assert not needs_rebalance([0.0, 0.0], 0.10)


def test_a_re_plan_is_one_line_and_memory_reads_in_units_that_fit_the_model():
    from mixtrain.cli.main import build_parser
    from mixtrain.observe.progress import format_bytes, plan_line
    from mixtrain.policies.planner import make_plan

    plan = make_plan([3000, 1000], 64, memory_caps=[None, None], comm_s=0.004)
    line = plan_line(plan, [32, 32], "re-planned after round 3")
    assert line == "re-planned after round 3: shares 32:32 -> 48:16, predicted 3,200 samples/s" and "\n" not in line
    assert [format_bytes(n) for n in (0, 900, 40_000, 5 * 2**20, 3 * 2**30)] == ["0 B", "900 B", "39 KiB", "5 MiB",
                                                                                 "3.0 GiB"]  # fmt: skip
    assert build_parser().parse_args(["train", "digits", "--plan-tables"]).plan_tables
