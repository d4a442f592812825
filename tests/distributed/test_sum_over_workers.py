"""mixtrain.train.sum_over_workers in a torch.distributed group with no mixtrain run around it (a script under
torchrun): the totals on every rank, and a rank that names its numbers differently is told so on every rank."""

from __future__ import annotations

from tests.distributed.ranks import run_ranks


def _sums(rank, world, names_differ):
    import mixtrain.train
    from mixtrain.errors import InputValueError

    values = {"correct": rank + 1, "count": 10 * (rank + 1)}
    if names_differ and rank == 2:
        values = {"right": rank + 1, "count": 10 * (rank + 1)}
    try:
        return mixtrain.train.sum_over_workers(values)
    except InputValueError as exc:
        return str(exc)


def test_every_rank_gets_the_totals_over_the_group():
    out = run_ranks(_sums, 3, False)
    assert all(out[r] == ("ok", {"correct": 6.0, "count": 60.0}) for r in range(3)), out


def test_different_names_on_one_rank_are_an_error_on_every_rank():
    out = run_ranks(_sums, 3, True)
    assert all(status == "ok" and "the workers gave different names" in text for status, text in out.values()), out
