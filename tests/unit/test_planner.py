import pytest

from mixtrain.planner import equal_shares, largest_remainder, resolve_shares, shares_for_step


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
    from mixtrain.planner import balanced_shares

    assert balanced_shares([3000, 1000], 64) == [48, 16]
    assert sum(balanced_shares([5.0, 3.0, 1.0], 97)) == 97
    assert balanced_shares([1e6, 1.0], 64)[1] == 1  # never 0: a worker at 0 could not be measured again


def test_plan_splits_shares_over_memory_caps_into_accumulation():
    from mixtrain.planner import make_plan

    plan = make_plan([3000, 1000], 64, memory_caps=[None, 5])
    assert plan.shares == [48, 16]
    assert plan.micro_batches == [48, 5] and plan.accumulation == [1, 4]
    assert abs(plan.predicted_step_s - 0.016) < 1e-12 and abs(plan.predicted_samples_per_s - 4000) < 1e-6
    fixed = make_plan([3000, 1000], 64, shares=[32, 32])
    assert fixed.shares == [32, 32] and abs(fixed.predicted_step_s - 0.032) < 1e-12


def test_plan_marks_a_device_that_slows_the_job_down():
    from mixtrain.planner import make_plan

    plan = make_plan([20000, 1000], 128, comm_s=0.010)
    assert list(plan.excluded) == [1] and "communication costs more" in plan.excluded[1]
    assert make_plan([3000, 1000], 64, comm_s=0.001).excluded == {}


def test_rebalance_only_past_the_threshold():
    from mixtrain.planner import needs_rebalance

    assert not needs_rebalance([0.100, 0.105], 0.10)
    assert needs_rebalance([0.100, 0.300], 0.10)
    assert not needs_rebalance([0.0, 0.0], 0.10)
