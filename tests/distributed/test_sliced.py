"""Gradients and weights sliced by memory (shard="gradients" | "full") on real gloo ranks: the same training as
one process, with compute shares 5:19:8 and memory slices 3:1:2, for SGD with momentum and for AdamW with a
scheduler and clipping, on a model with a tied embedding, a frozen part and activation checkpointing; each rank
holds only its slice between steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixtrain.comm.strategy import JoinContext
from mixtrain.config import StrategyConfig
from mixtrain.shard.sliced import SlicedStrategy
from mixtrain.task import Task
from tests.distributed.ranks import run_ranks

SHARES = (5, 19, 8)
SLICES = (3.0, 1.0, 2.0)
MICRO = (2, 7, 3)  # per rank: 3, 3 and 3 micro-batches of a step's 5, 19 and 8 samples; evened out anyway
STEPS = 4
VOCAB, WIDTH, LENGTH = 23, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """An embedding tied to the head (as GPT-2's lm_head is wte), three blocks, a frozen projection."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.wte(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _task(opt: str, checkpointing: bool, blocks: tuple = ()) -> Task:
    torch.manual_seed(0)
    model = TinyLM()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if opt == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(trainable, lr=0.1, momentum=0.9)
        return Task(model=model, optimizer=optimizer, loss_fn=_loss, shard_blocks=blocks)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    return Task(
        model=model,
        optimizer=optimizer,
        loss_fn=_loss,
        max_grad_norm=0.5,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        activation_checkpointing=(Block,) if checkpointing else (),
        shard_blocks=blocks,
    )


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (sum(SHARES), LENGTH + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _even_chunks(rank: int) -> list[torch.Tensor]:
    """This rank's samples of a step, in as many micro-batches as the busiest rank needs."""
    lo = sum(SHARES[:rank])
    counts = [-(-s // m) for s, m in zip(SHARES, MICRO)]
    return list(torch.arange(lo, lo + SHARES[rank]).tensor_split(max(counts)))


def _sliced(rank, world, level, opt, checkpointing, offload, blocks=()):
    torch.set_num_threads(1)
    task = _task(opt, checkpointing, blocks)
    strategy = SlicedStrategy(StrategyConfig(), level)
    ctx = JoinContext(
        bucket_bytes=1 << 20,
        loss_scaling=False,
        rank=rank,
        world_size=world,
        timeout_s=20.0,
        shard_weights=SLICES,
        offload=offload,
    )
    strategy.setup(task, ctx)
    total = sum(SHARES)
    held, losses = [], []
    task.model.train()
    for step in range(STEPS):
        x, y = _batch(step)
        strategy.zero_grad(task)
        local = torch.zeros(1)
        for chunk in _even_chunks(rank):
            if len(chunk) == 0:
                raise AssertionError("the test's shares give every rank samples in every micro-batch")
            loss = task.loss_fn(task.model(x[chunk]), y[chunk])
            (loss * (len(chunk) / total)).backward()
            local += loss.detach() * len(chunk) / total
        outcome = strategy.step(task, local, SHARES[rank] / total)
        losses.append(float(outcome.done[0].stats[0]))
        held.append(strategy.held_bytes(task))
    state = strategy.model_state(task)
    part = strategy.model_part(task)
    storages = _gathered_storages(strategy, rank)
    strategy.close()
    own = all(
        p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()
        for p in task.model.parameters()
    )
    return {
        "storages": storages,
        "own_storage": own,
        "state": {k: v.clone() for k, v in state.items() if v is not None},
        "foreign": sorted(k for k, v in state.items() if v is None),
        "part": {k: v.clone() for k, v in part.items()},
        "optimizer": strategy.optimizer_state(task)["state"],
        "held": held[-1],
        "prefetched": strategy.prefetched,
        "masters": len(strategy.shard.master) if strategy.shard is not None else 0,
        "losses": losses,
        "blocks": [type(u.module).__name__ for u in strategy.units if u.module is not None],
    }


def _gathered_storages(strategy: SlicedStrategy, rank: int) -> tuple[int, int]:
    """(groups of another owner's weights, distinct storages they hold) in the first block, gathered (a collective:
    every rank calls this alike)."""
    unit = strategy.units[1]
    strategy.gathers.gather(unit)
    groups = [params for owner, _, params in unit.groups if owner != rank]
    ptrs = {p.untyped_storage().data_ptr() for params in groups for p in params}
    strategy.gathers.release(unit)
    return len(groups), len(ptrs)


def _reference(opt: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    task = _task(opt, False)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        task.optimizer.zero_grad()
        loss = task.loss_fn(task.model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        if task.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(task.model.parameters(), task.max_grad_norm)
        task.optimizer.step()
        if task.scheduler is not None:
            task.scheduler.step()
    return task.model.state_dict(), losses


@pytest.mark.parametrize(
    "level,opt,checkpointing,offload,blocks",
    [
        ("full", "sgd", False, False, ()),
        ("full", "adamw", True, True, ()),  # the optimizer's slice stepped from a host copy (offload="optimizer")
        ("gradients", "adamw", False, False, ()),
        ("gradients", "sgd", True, True, ()),
        # blocks named (Task.shard_blocks): each Block's MLP, its LayerNorm left to the root; by class and by name
        ("full", "adamw", False, False, (nn.Sequential,)),
        ("full", "sgd", True, False, ("Sequential",)),
    ],
)
def test_sliced_training_equals_one_process_and_each_rank_holds_its_slice(level, opt, checkpointing, offload, blocks):
    out = run_ranks(_sliced, 3, level, opt, checkpointing, offload, blocks, timeout_s=60.0)
    assert all(status == "ok" for status, _ in out.values()), out
    named = "Sequential" if blocks else "Block"  # (RecomputedBlock under activation checkpointing)
    found = [out[r][1]["blocks"] for r in range(3)]
    assert all(len(f) == 3 and all(b.endswith(named) for b in f) for f in found), found
    want, want_losses = _reference(opt)
    results = [out[r][1] for r in range(3)]
    merged = dict(results[0]["state"])
    for res in results[1:]:
        merged.update(res["part"])
    assert merged.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for res in results:
        assert res["losses"] == pytest.approx(want_losses, rel=1e-5)
    whole = sum(p.numel() * p.element_size() for p in _task(opt, False).model.parameters())
    optimizer_keys = sorted(k for res in results for k in res["optimizer"])
    assert optimizer_keys == sorted(set(optimizer_keys)), "each optimizer entry on exactly one rank"
    if offload:  # each rank's master copies are exactly its owned parameters
        assert sum(res["masters"] for res in results) == len(
            [p for p in _task(opt, False).model.parameters() if p.requires_grad]
        )
    else:
        assert all(res["masters"] == 0 for res in results)
    if level == "full":
        parts = [set(res["part"]) for res in results]
        assert not parts[0] & parts[1] and not parts[1] & parts[2] and not parts[0] & parts[2]
        assert all(res["held"] < whole for res in results), [res["held"] for res in results]
        assert all(res["foreign"] for res in results)
        # another owner's weights of a block, gathered: one storage per owner (views of one flat tensor)
        assert all(res["storages"][0] == res["storages"][1] for res in results), [r["storages"] for r in results]
        # blocks 2 and 3 of each forward were gathered while the one before computed (after the first forward)
        passes = (STEPS - 1) * max(-(-s // m) for s, m in zip(SHARES, MICRO))
        assert all(res["prefetched"] >= 2 * passes for res in results), [res["prefetched"] for res in results]
    else:
        assert all(res["held"] == whole for res in results)
        assert all(not res["foreign"] for res in results)
    assert all(res["own_storage"] for res in results), "close() gives every weight its own storage back"
