"""A tiny Hugging Face GPT-2 with `peft` LoRA adapters, built from a config (nothing downloaded), its data, and
the one-process loop over the whole global batch that training on any split must equal; a `mixtrain.train`
loop of it that checkpoints only the adapters. Importable on Ray workers (the conftest puts the repo on
PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from mixtrain import Task
from mixtrain.data.sampling import epoch_permutation, steps_per_epoch

VOCAB = 64
CONTEXT = 16
B = 64
N = 64 * 4 + 20  # 5 steps an epoch, the last one of 20
SEED = 7


def config(n_embd: int = 128) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=n_embd, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def base(base_seed: int = 0) -> torch.nn.Module:
    """The "pretrained" base: seeded, so every worker and the reference build the same one."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(base_seed)
    return GPT2LMHeadModel(config())


def lora_model(base_seed: int = 0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        base(base_seed), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"])
    )
    torch.manual_seed(1)  # the adapters' own start, the same on every worker
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a nonzero start makes the first steps move the base's output
            torch.nn.init.normal_(p, std=0.02)
    return model


def lm_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def task(base_seed: int = 0) -> Task:
    model = lora_model(base_seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return Task(model=model, optimizer=opt, compute_loss=lm_loss)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (N, CONTEXT), generator=torch.Generator().manual_seed(3))
    return ids, ids.clone()


def reference(epochs: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch of each step in the epoch's order."""
    t = task()
    x, y = data()
    for epoch in range(epochs):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, N))
        for step in range(steps_per_epoch(N, B)):
            idx = perm[step * B : (step + 1) * B]
            t.optimizer.zero_grad()
            lm_loss(t.model, (x[idx], y[idx])).backward()
            t.optimizer.step()
    return t.model.state_dict()


def adapter_bytes(model: torch.nn.Module) -> int:
    """The trainable parameters' bytes and their AdamW state's (two moments each): what a checkpoint must hold."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def lora_loop(config: dict[str, Any]) -> None:
    """A plain loop of the LoRA model; rank 0 checkpoints only the adapters (trainable_state_dict) each epoch."""
    import tempfile

    import mixtrain.train
    from mixtrain.train import Checkpoint
    from mixtrain.train.torch import prepare_data_loader, prepare_model, trainable_state_dict

    model = prepare_model(lora_model())
    x, y = data()
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=config["batch"], shuffle=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for epoch in range(config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for ids, labels in loader:
            loss = lm_loss(model, (ids, labels))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if mixtrain.train.get_context().get_world_rank() == 0:
                state = {"model": trainable_state_dict(model.module), "optimizer": opt.state_dict(), "epoch": epoch}
                torch.save(state, Path(folder) / "state.pt")
                saved = Checkpoint.from_directory(folder)
            mixtrain.train.report({"loss": float(loss.detach())}, checkpoint=saved)
