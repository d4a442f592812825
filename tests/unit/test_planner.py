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
