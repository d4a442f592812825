"""Training loops of the kinds people bring (a plain SGD loop, AdamW with a schedule and clipping, accumulation
with no_sync, a small GAN), each beside the one-process loop over the whole global batch it must equal.
Importable on Ray workers (the conftest puts the repo on PYTHONPATH). Data comes from the config: the same
tensors on every worker and in the reference."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixtrain.train
from mixtrain.data.sampling import epoch_permutation
from mixtrain.train.torch import prepare_data_loader, prepare_model

SEED = 5


def data(num: int = 150, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, 12, generator=g), torch.randint(0, 4, (num,), generator=g)


def net(width: int = 24) -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(12, width), nn.Tanh(), nn.Linear(width, 4))


def _opt(kind: str, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9), None
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any, x: torch.Tensor, y: torch.Tensor, clip: bool
) -> float:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    if sched is not None:
        sched.step()
    return float(loss.detach())


def classifier_loop(config: dict[str, Any]) -> None:
    """A plain loop: prepare, iterate, step, report; rank 0 saves the weights it ended with."""
    x, y = config["data"]
    model = prepare_model(net(config.get("width", 24)))
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch"], shuffle=True))
    opt, sched = _opt(config["opt"], model.parameters())
    for epoch in range(config["epochs"]):
        for xb, yb in loader:
            if config.get("accumulate"):
                with model.no_sync():  # two halves of each batch: the first only accumulates
                    half = len(yb) // 2
                    (nn.functional.cross_entropy(model(xb[:half]), yb[:half]) * half / len(yb)).backward()
                loss = nn.functional.cross_entropy(model(xb[half:]), yb[half:]) * (len(yb) - half) / len(yb)
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                _step(model, opt, sched, xb, yb, config.get("clip", False))
        mixtrain.train.report({"epoch": epoch})
    _save(config, model.module)


def reference(config: dict[str, Any], workers: int) -> dict[str, torch.Tensor]:
    """One process, each step the whole global batch (batch x workers) in the same order."""
    x, y = config["data"]
    model = net(config.get("width", 24))
    opt, sched = _opt(config["opt"], model.parameters())
    big = config["batch"] * workers
    for epoch in range(config["epochs"]):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(y)))
        for t in range(-(-len(y) // big)):
            idx = perm[t * big : (t + 1) * big]
            if config.get("accumulate"):
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            else:
                _step(model, opt, sched, x[idx], y[idx], config.get("clip", False))
    return model.state_dict()


def _save(config: dict[str, Any], module: nn.Module) -> None:
    if mixtrain.train.get_context().get_world_rank() == 0:
        torch.save(module.state_dict(), Path(config["out"]) / "weights.pt")


# ---- a small GAN: two models, two optimizers; each sample carries its own noise ------------------------------
def gan_data(num: int = 120) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    real = torch.randn(num, 2, generator=g) * 0.5 + 1.0
    noise = torch.randn(num, 3, generator=g)
    return real, noise


def gan_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)), nn.Sequential(
        nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1)
    )


def _gan_step(g: nn.Module, d: nn.Module, og: Any, od: Any, real: torch.Tensor, noise: torch.Tensor) -> None:
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = g(noise)
    d_loss = bce(d(real), torch.ones(len(real), 1)) + bce(d(fake.detach()), torch.zeros(len(real), 1))
    od.zero_grad()
    d_loss.backward()
    od.step()
    g_loss = bce(d(fake), torch.ones(len(real), 1))
    og.zero_grad()
    g_loss.backward()
    og.step()


def gan_loop(config: dict[str, Any]) -> None:
    real, noise = config["data"]
    gen, disc = gan_nets()
    g, d = prepare_model(gen), prepare_model(disc)
    og, od = torch.optim.Adam(g.parameters(), lr=1e-2), torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.5)
    loader = prepare_data_loader(DataLoader(TensorDataset(real, noise), batch_size=config["batch"], shuffle=True))
    for epoch in range(config["epochs"]):
        for r, z in loader:
            _gan_step(g, d, og, od, r, z)
        mixtrain.train.report({"epoch": epoch})
    if mixtrain.train.get_context().get_world_rank() == 0:
        torch.save({"g": g.module.state_dict(), "d": d.module.state_dict()}, Path(config["out"]) / "weights.pt")


def gan_reference(config: dict[str, Any], workers: int) -> dict[str, dict[str, torch.Tensor]]:
    real, noise = config["data"]
    g, d = gan_nets()
    og, od = torch.optim.Adam(g.parameters(), lr=1e-2), torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.5)
    big = config["batch"] * workers
    for epoch in range(config["epochs"]):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(real)))
        for t in range(-(-len(real) // big)):
            idx = perm[t * big : (t + 1) * big]
            _gan_step(g, d, og, od, real[idx], noise[idx])
    return {"g": g.state_dict(), "d": d.state_dict()}


# ---- what a loop sees ------------------------------------------------------------------------------------------
def order_loop(config: dict[str, Any]) -> None:
    """Records the sample indices each worker gets per epoch: shuffled with set_epoch, and a sequential loader."""
    n = config["n"]
    ids = torch.arange(n)
    shuffled = prepare_data_loader(DataLoader(TensorDataset(ids), batch_size=4, shuffle=True))
    ordered = prepare_data_loader(DataLoader(TensorDataset(ids), batch_size=4, shuffle=False))
    seen: dict[str, list[list[int]]] = {"epoch3": [], "epoch3again": [], "next": [], "ordered": []}
    shuffled.sampler.set_epoch(3)
    seen["epoch3"] = [b[0].tolist() for b in shuffled]
    shuffled.sampler.set_epoch(3)
    seen["epoch3again"] = [b[0].tolist() for b in shuffled]
    seen["next"] = [b[0].tolist() for b in shuffled]  # no set_epoch: the next epoch (4)
    seen["ordered"] = [b[0].tolist() for b in ordered]
    ctx = mixtrain.train.get_context()
    torch.save(
        {"seen": seen, "device": str(ctx.get_device()), "share": ctx.get_share(), "len": len(shuffled)},
        Path(config["out"]) / f"rank{ctx.get_world_rank()}.pt",
    )


def held_out_loop(config: dict[str, Any]) -> None:
    """Trains one epoch, then counts right answers on a prepared held-out loader (each worker its share of it)
    and sums the counts over the workers: rank 0 reports the whole set's accuracy and saves its weights."""
    x, y = config["data"]
    held_x, held_y = config["held_out"]
    model = prepare_model(net())
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch"], shuffle=True))
    held = prepare_data_loader(DataLoader(TensorDataset(held_x, held_y), batch_size=config["batch"]))
    opt, _ = _opt("sgd", model.parameters())
    for xb, yb in loader:
        _step(model, opt, None, xb, yb, False)
    correct, count = 0, 0
    with torch.no_grad():
        for xb, yb in held:
            correct += int((model(xb).argmax(1) == yb).sum())
            count += len(yb)
    totals = mixtrain.train.sum_over_workers({"correct": correct, "count": count})
    mixtrain.train.report({"accuracy": totals["correct"] / totals["count"], "count": totals["count"], "own": count})
    _save(config, model.module)


def raising_loop(config: dict[str, Any]) -> None:
    prepare_model(net())
    if mixtrain.train.get_context().get_world_rank() == 1:
        raise ValueError("a bug in the user's loop on worker 1")
    mixtrain.train.report({"fine": 1})


def checkpointing_loop(config: dict[str, Any]) -> None:
    """Checkpoints every epoch; resumes from get_checkpoint() (unless config["resume"] is False: a loop ported from a
    script that reports checkpoints and never reads one); worker 1 kills its own process once, mid-epoch 2."""
    import tempfile

    x, y = config["data"]
    model = prepare_model(net())
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch"], shuffle=True))
    opt, _ = _opt("sgd", model.parameters())
    start = 0
    checkpoint = mixtrain.train.get_checkpoint() if config.get("resume", True) else None
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
        (Path(config["out"]) / f"restarted-from-{start}").touch()
    marker = Path(config["out"]) / "killed"
    rank = mixtrain.train.get_context().get_world_rank()
    for epoch in range(start, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            if config.get("kill", True) and epoch == 2 and step == 2 and rank == 1 and not marker.exists():
                marker.touch()
                os._exit(1)  # the process dies mid-epoch, as a laptop that leaves
            _step(model, opt, None, xb, yb, False)
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if rank == 0:
                torch.save(
                    {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                    Path(tmp) / "state.pt",
                )
                checkpoint = mixtrain.train.Checkpoint.from_directory(tmp)
            mixtrain.train.report({"epoch": epoch}, checkpoint=checkpoint)
    _save(config, model.module)


class Noisy(torch.utils.data.Dataset):
    """Augmentation as a Dataset does it: each read adds fresh noise from torch's global random stream."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.3 * torch.randn(self.x.shape[1]), self.y[i]


def augmented_loop(config: dict[str, Any]) -> None:
    x, y = config["data"]
    model = prepare_model(net(config.get("width", 24)))
    loader = prepare_data_loader(DataLoader(Noisy(x, y), batch_size=config["batch"], shuffle=True, num_workers=1))
    opt, _ = _opt("sgd", model.parameters())
    for _ in range(config["epochs"]):
        for xb, yb in loader:
            _step(model, opt, None, xb, yb, False)
        mixtrain.train.report({})
    _save(config, model.module)


def augmented_reference(config: dict[str, Any], workers: int) -> dict[str, torch.Tensor]:
    """One process reading each sample under mixtrain's per-sample seeding rule (mixtrain.data.seed_sample)."""
    from mixtrain.data import seed_sample

    x, y = config["data"]
    data = Noisy(x, y)
    model = net(config.get("width", 24))
    opt, _ = _opt("sgd", model.parameters())
    big = config["batch"] * workers
    for epoch in range(config["epochs"]):
        perm = epoch_permutation(SEED, epoch, len(y))
        for t in range(-(-len(y) // big)):
            samples = []
            for i in perm[t * big : (t + 1) * big]:
                seed_sample(SEED, epoch, int(i))
                samples.append(data[int(i)])
            xb, yb = torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
            _step(model, opt, None, xb, yb, False)
    return model.state_dict()


# ---- a loop written the common way: its batch divided by the world size, a schedule sized by len(loader) --------
def _one_cycle(params: Any, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=total_steps)


def one_cycle_loop(config: dict[str, Any]) -> None:
    """batch_size=BATCH // world_size and OneCycleLR(total_steps=epochs * len(loader)), resumed with its schedule from
    get_checkpoint(); reports len(loader), the scheduler's step count and the rate of each epoch's last step."""
    import tempfile

    x, y = config["data"]
    ctx = mixtrain.train.get_context()
    batch = config["batch"] // ctx.get_world_size()
    model = prepare_model(net())
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True))
    opt, sched = _one_cycle(model.parameters(), config["epochs"] * len(loader))
    start = 0
    checkpoint = mixtrain.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = state["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            lr = opt.param_groups[0]["lr"]  # the rate this step takes
            _step(model, opt, sched, xb, yb, False)
        metrics = {"epoch": epoch, "len": len(loader), "steps": sched.last_epoch, "lr": lr}
        with tempfile.TemporaryDirectory() as tmp:
            saved = None
            if ctx.get_world_rank() == 0:
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
                torch.save({**state, "epoch": epoch}, Path(tmp) / "state.pt")
                saved = mixtrain.train.Checkpoint.from_directory(tmp)
            mixtrain.train.report(metrics, checkpoint=saved)
    _save(config, model.module)


def one_cycle_reference(config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], float]:
    """One process, each step the whole global batch (config["batch"]): the weights and the last step's learning
    rate."""
    x, y = config["data"]
    model, big = net(), config["batch"]
    steps = -(-len(y) // big)
    opt, sched = _one_cycle(model.parameters(), config["epochs"] * steps)
    for epoch in range(config["epochs"]):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(y)))
        for t in range(steps):
            idx = perm[t * big : (t + 1) * big]
            lr = opt.param_groups[0]["lr"]
            _step(model, opt, sched, x[idx], y[idx], False)
    return model.state_dict(), lr


# ---- state sliced by owner (prepare_model(shard=...)): AdamW, a schedule and the prepared model's clipping ------
def sliced_loop(config: dict[str, Any]) -> None:
    """AdamW with a cosine schedule and clipping on a model prepared with shard=config["shard"]; every worker gathers
    the whole weights and optimizer state (config["rank0_only"]: worker 0 alone), as a checkpoint would, and rank 0
    saves them with what each holds."""
    x, y = config["data"]
    blocks = tuple(config.get("blocks", ()))
    model = prepare_model(net(), shard=config["shard"], slices=config.get("slices"), blocks=blocks)
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch"], shuffle=True))
    opt, sched = _opt("adamw", model.parameters())
    for epoch in range(config["epochs"]):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            model.clip_grad_norm_(0.5)
            opt.step()
            sched.step()
        mixtrain.train.report({"epoch": epoch})
    first = config.get("rank0_only", False)
    weights, state = model.full_state_dict(rank0_only=first), model.full_optimizer_state_dict(opt, rank0_only=first)
    held = {
        "grads": sorted(n for n, p in model.module.named_parameters() if p.grad is not None),
        "state": sorted(opt.state_dict()["state"]),
        "bytes": sum(p.untyped_storage().nbytes() for p in model.module.parameters()),
        "gathered": (len(weights), len(state)),
    }
    rank = mixtrain.train.get_context().get_world_rank()
    torch.save(held, Path(config["out"]) / f"held{rank}.pt")
    if rank == 0:
        torch.save({"model": weights, "opt": state}, Path(config["out"]) / "sliced.pt")


def sliced_reference(config: dict[str, Any], workers: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One process over the whole global batch: its weights and optimizer state_dict."""
    x, y = config["data"]
    model = net()
    opt, sched = _opt("adamw", model.parameters())
    big = config["batch"] * workers
    for epoch in range(config["epochs"]):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(y)))
        for t in range(-(-len(y) // big)):
            idx = perm[t * big : (t + 1) * big]
            _step(model, opt, sched, x[idx], y[idx], True)
    return model.state_dict(), opt.state_dict()
