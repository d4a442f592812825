"""A prepared loader over a Dataset, on two real gloo ranks: when the shares move within an epoch, the same loader
processes go on reading (issue 45: a new DataLoader at every move forked new ones at steps 2, 4, 8, ...), the
batches they had read ahead by the old shares are not handed out, and every step still holds the epoch's samples
in the seeded order, each with the random view `seed_sample` gives it."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import torch

from tests.distributed.ranks import run_ranks

SEED, NUM, BATCH, EPOCHS = 5, 64, 4, 2  # global batch 8 over 2 ranks: 8 steps an epoch, plan points at 2 and 4
COST_S = (0.001, 0.003)  # compute seconds per sample of rank 0 and rank 1 on a fake clock: rank 1 is 3x slower


class Views(torch.utils.data.Dataset):
    """Each read: the index, a view drawn from torch's, numpy's and Python's streams, and the reading process."""

    def __len__(self) -> int:
        return NUM

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        view = torch.tensor([float(torch.rand(())), float(np.random.rand()), random.random()]) + i
        return torch.tensor(i), view, torch.tensor(os.getpid())


def _read_epochs(rank: int, world: int) -> dict:
    from torch.utils.data import DataLoader

    from mixtrain.train import _session
    from mixtrain.train._prepare import PreparedLoader
    from mixtrain.train._session import LoopSession, TrainContext

    clock = [0.0]  # moves only by each rank's compute, so the shares move the same way on any machine's load
    _session.time = SimpleNamespace(perf_counter=lambda: clock[0])  # type: ignore[assignment]
    plans: list[dict] = []
    ctx = TrainContext(
        world_rank=rank, world_size=world, local_rank=rank, local_world_size=world, node_rank=0,
        device=torch.device("cpu"), experiment_name="t",
    )  # fmt: skip
    session = LoopSession(
        context=ctx, seed=SEED, shares="auto", bucket_bytes=1 << 20, report_to=lambda *a: False,
        plan_to=plans.append, batch_workers=world,
    )  # fmt: skip
    loader = PreparedLoader(DataLoader(Views(), batch_size=BATCH, shuffle=True, num_workers=1), session)
    torch.manual_seed(123)  # the loop's own stream: reading must leave it where it was
    epochs = []
    for _ in range(EPOCHS):
        steps = []
        for index, view, pid in loader:
            steps.append({"index": index.tolist(), "view": view, "pid": set(pid.tolist())})
            clock[0] += COST_S[rank] * len(index)
        epochs.append(steps)
    return {"epochs": epochs, "plans": plans, "pid": os.getpid(), "stream": torch.rand(()).item()}


def _view(epoch: int, i: int) -> torch.Tensor:
    from mixtrain.data import seed_sample

    seed_sample(SEED, epoch, i)
    return Views()[i][1]


def test_shares_moved_within_an_epoch_keep_the_loader_processes_and_every_steps_samples_and_views():
    from mixtrain.data.sampling import epoch_permutation

    out = run_ranks(_read_epochs, 2, timeout_s=60)
    assert all(status == "ok" for status, _ in out.values()), out
    ranks = [out[r][1] for r in range(2)]
    moves = [(p["epoch"], p["step"], p["shares"]) for p in ranks[0]["plans"] if p["moved"] and p["step"] > 0]
    # the first plan point whose window holds 3 measured steps (LoopSession.measured): step 4 of 8
    assert moves and moves[0][:2] == (0, 4) and moves[0][2][0] > moves[0][2][1], ranks[0]["plans"]
    for r in ranks:  # one loader process an epoch, as the user's own loader
        assert [len(set().union(*(s["pid"] for s in steps)) - {r["pid"]}) for steps in r["epochs"]] == [1] * EPOCHS
    torch.manual_seed(123)
    untouched = torch.rand(()).item()
    assert [r["stream"] for r in ranks] == [untouched] * 2  # the loop's own stream: the reads left it be
    for epoch in range(EPOCHS):
        perm = epoch_permutation(SEED, epoch, NUM).tolist()
        for t in range(NUM // (BATCH * 2)):
            got = ranks[0]["epochs"][epoch][t]["index"] + ranks[1]["epochs"][epoch][t]["index"]
            assert got == perm[t * 8 : (t + 1) * 8], (epoch, t)  # rank 0's slice, then rank 1's, by the shares
            for r in ranks:
                step = r["epochs"][epoch][t]
                want = torch.stack([_view(epoch, i) for i in step["index"]])
                assert torch.equal(step["view"], want), (epoch, t)
    # the batches the loader process had read ahead by the old shares were read again here, by the new ones
    assert any(ranks[0]["pid"] in s["pid"] for s in ranks[0]["epochs"][0][4:6])
