"""The held-out set: split by measured speed, in batches each worker's memory allows, and what a worker could
not fit handed to the others (Ray-free; tests/ray/test_faults.py runs it for real)."""

from __future__ import annotations

from mixtrain.driver.schedule import EVAL_BATCH, eval_batches, eval_split
from mixtrain.worker import evaluation


def test_the_held_out_set_is_split_by_measured_speed_and_equally_before_that():
    bounds, deadline = eval_split(1000, 2, [3000.0, 1000.0], 60.0, 600.0)
    assert bounds == [(0, 750), (750, 1000)]  # the fast card takes three quarters, not half
    assert deadline == 60.0 + 2 * 0.25
    assert eval_split(1000, 2, None, 60.0, 600.0) == ([(0, 500), (500, 1000)], 600.0)
    assert eval_split(3, 4, [1.0, 1.0, 1.0, 1.0], 60.0, 600.0)[0][-1] == (3, 3)  # fewer samples than workers


def test_each_worker_starts_from_its_memory_cap_or_the_default_batch():
    assert eval_batches([None, 48, 4096]) == [EVAL_BATCH, 48, EVAL_BATCH]


def test_a_slice_left_by_an_out_of_memory_worker_goes_to_the_others():
    parts = [{"loss_sum": 1.0, "samples": 10.0}, {"loss_sum": 0.5, "samples": 4.0, evaluation.LEFT: 14.0}, {}]
    passes, note = evaluation.leftovers(parts, [(0, 10), (10, 30), (30, 30)])
    assert passes == [[(14, 22), (14, 14), (22, 30)]] and "worker 1" in note and "16 samples" in note
    assert evaluation.summarize(parts)["samples"] == 14  # the marker is no figure
    none_able = [{evaluation.LEFT: 0.0}]
    passes, note = evaluation.leftovers(none_able, [(0, 5)])
    assert passes == [] and "5 samples not evaluated" in note
    assert evaluation.summarize([{}])["samples"] == 0  # nothing evaluated: a NaN loss, not a crash
    assert evaluation.leftovers(parts[:1], [(0, 10)]) == ([], "")
