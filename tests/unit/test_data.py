import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from mixtrain.data.sampling import epoch_permutation, step_size, steps_per_epoch, to_arrays, worker_indices


@pytest.mark.parametrize("num_samples", [64 * 5, 64 * 5 + 17, 3, 1000])
@pytest.mark.parametrize("shares", [[32, 32], [40, 24], [30, 20, 14], [1, 62, 1], [64]])
def test_every_sample_exactly_once_per_epoch(num_samples, shares):
    perm = epoch_permutation(seed=3, epoch=2, num_samples=num_samples)
    seen = []
    for step in range(steps_per_epoch(num_samples, 64)):
        parts = [worker_indices(perm, 64, step, shares, r) for r in range(len(shares))]
        assert sum(len(p) for p in parts) == step_size(num_samples, 64, step)
        for part in parts:
            seen.extend(part.tolist())
    assert sorted(seen) == list(range(num_samples))


def test_step_order_is_the_permutation_whatever_the_split():
    perm = epoch_permutation(0, 0, 200)
    for shares in ([32, 32], [50, 14], [10, 20, 34]):
        step1 = np.concatenate([worker_indices(perm, 64, 1, shares, r) for r in range(len(shares))])
        assert step1.tolist() == perm[64:128].tolist()


def test_permutation_depends_on_seed_and_epoch_only():
    a = epoch_permutation(1, 0, 50)
    assert a.tolist() == epoch_permutation(1, 0, 50).tolist()
    assert a.tolist() != epoch_permutation(1, 1, 50).tolist()
    assert a.tolist() != epoch_permutation(2, 0, 50).tolist()


class Squares(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i * i


def test_to_arrays_accepts_datasets_and_tuples():
    x, y = to_arrays(Squares())
    assert x.shape == (5, 1) and y.tolist() == [0, 1, 4, 9, 16]
    x2, y2 = to_arrays(TensorDataset(torch.ones(4, 2), torch.zeros(4)))
    assert x2.shape == (4, 2) and y2.shape == (4,)
    (only,) = to_arrays((torch.arange(3),))
    assert only.tolist() == [0, 1, 2]


def test_to_arrays_errors_are_clear():
    with pytest.raises(ValueError, match="empty"):
        to_arrays(TensorDataset(torch.ones(0, 2), torch.zeros(0)))
    with pytest.raises(ValueError, match="different lengths"):
        to_arrays((torch.ones(4, 2), torch.zeros(3)))
    with pytest.raises(TypeError, match="not supported"):
        to_arrays("not a dataset")


def test_per_device_pace_cuts_a_workers_samples_into_inner_batches_across_steps():
    from mixtrain.worker.worker_data import paced_segments

    # 3 steps of 5 samples each on this worker, micro-batches of at most 3; inner batches of 4; an exchange
    # after step 1 (the second): what is left there is stepped on, and counting starts again
    steps = [(s, 16, [np.arange(5 * s, 5 * s + 3), np.arange(5 * s + 3, 5 * s + 5)]) for s in range(3)]
    out = paced_segments(steps, 4, [False, True, False])
    flat = [(list(map(list, seg)), fraction) for _, _, segments in out for seg, fraction in segments]
    assert flat == [
        ([[0, 1, 2], [3]], 1.0),
        ([[4]], 0.0),  # step 0 ends with 1 sample towards the next inner batch
        ([[5, 6, 7]], 1.0),
        ([[8, 9]], 0.5),  # the exchange: the 2 left are stepped on
        ([[10, 11, 12], [13]], 1.0),
        ([[14]], 0.0),
    ]
    assert [(step, total) for step, total, _ in out] == [(0, 16), (1, 16), (2, 16)]
    # every sample once, in order, and no piece longer than its micro-batch
    assert np.concatenate([c for _, _, segs in out for seg, _ in segs for c in seg]).tolist() == list(range(15))
    # a step with no samples here still steps on what is left when an exchange follows it
    empty = paced_segments([(0, 8, [np.arange(3)]), (1, 8, [])], 4, [False, True])
    assert [[f for _, f in segs] for _, _, segs in empty] == [[0.0], [0.75]]
    assert empty[1][2][0][0] == []


def test_one_pace_object_answers_how_a_worker_steps_and_weighs_its_losses():
    from mixtrain.worker.worker_data import PER_STEP, Pace

    steps = [(0, 8, [np.arange(3), np.arange(3, 5)]), (1, 8, [np.arange(5, 8)])]
    assert PER_STEP.per_step and PER_STEP.grad_weight(3, 8) == 3 / 8  # a share of the global step
    assert [(s, t, [(list(map(len, c)), f) for c, f in seg]) for s, t, seg in PER_STEP.segments(steps, [])] == [
        (0, 8, [([3, 2], 0.0)]),
        (1, 8, [([3], 0.0)]),
    ]
    paced = Pace(inner=4)  # local SGD at per-device pace: an update every 4 samples of this worker's own
    assert not paced.per_step and paced.grad_weight(3, 8) == 3 / 4
    cut = paced.segments(steps, [False, True])
    assert [[(list(map(len, c)), f) for c, f in seg] for _, _, seg in cut] == [
        [([3, 1], 1.0), ([1], 0.0)],
        [([3], 1.0)],
    ]
