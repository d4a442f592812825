"""Checkpoints of a model with a frozen base (a LoRA run) hold only what trains: the trainable parameters, the
buffers, the optimizer's state and a fingerprint of the base; a resume onto another base is one line; a peft
model's hf_model folder is its adapter folder. No Ray."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from mixtrain.checkpoint import CheckpointStore
from mixtrain.errors import InputValueError
from mixtrain.frozen_base import check_resume, describe, load_model_state, trim
from mixtrain.train.torch import load_trainable_state_dict, trainable_state_dict


def _net(seed: int = 0, frozen: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
    if frozen:
        model[0].requires_grad_(False)  # the "pretrained" base
    return model


def _meta(step: int) -> dict:
    return {"epoch": 0, "step": step, "global_step": step, "shares": [8], "num_workers": 1, "workers": []}


def test_a_checkpoint_leaves_the_frozen_base_out_and_a_resume_onto_another_base_is_one_line(tmp_path):
    model = _net()
    base = describe(model)
    assert base is not None and set(base.tensors) == {"0.weight", "0.bias"}
    assert base.num_bytes == (64 * 64 + 64) * 4
    assert describe(_net(frozen=False)) is None  # every parameter trains: nothing to leave out
    store = CheckpointStore(tmp_path, base=base)
    path = store.save({"model": model.state_dict(), "optimizer": {}}, _meta(3))
    state, manifest = CheckpointStore.read(path)
    assert set(state["model"]) == set(model.state_dict()) - {"0.weight", "0.bias"}  # BatchNorm's buffers stay
    assert sum(f.stat().st_size for f in path.iterdir()) < (64 * 64) * 4  # less than the base alone
    check_resume(manifest, describe(_net()), path)  # the same base: fine
    other = _net(seed=1)
    with pytest.raises(InputValueError) as err:
        check_resume(manifest, describe(other), path)
    message = str(err.value)
    assert "\n" not in message and "0.bias (float32[64]) holds other values" in message and "start a new run" in message
    with pytest.raises(InputValueError, match=r"0\.bias was float32\[64\], is bfloat16\[64\]"):
        check_resume(manifest, describe(_net().to(torch.bfloat16)), path)
    with pytest.raises(InputValueError, match="no frozen parameters"):
        check_resume(manifest, describe(_net(frozen=False)), path)
    # what a worker does with it: the base it built stays, the rest is loaded
    fresh = _net()
    fresh[2].weight.data.zero_()
    load_model_state(fresh, state["model"])
    for name, want in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], want), name
    with pytest.raises(InputValueError, match=r"lacks 1 tensor\(s\) the model trains or keeps, e.g. \['2.bias'\]"):
        load_model_state(fresh, {k: v for k, v in state["model"].items() if k != "2.bias"})
    # a whole checkpoint (no base left out) resumes onto anything, as before
    whole = CheckpointStore(tmp_path / "whole").save({"model": model.state_dict()}, _meta(1))
    check_resume(CheckpointStore.read(whole)[1], describe(other), whole)
    assert set(trim(model.state_dict(), base)) == set(state["model"])


def test_the_loop_helpers_save_the_trainable_part_and_refuse_another_base(tmp_path):
    model = _net()
    saved = trainable_state_dict(model)
    torch.save(saved, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert "0.weight" not in loaded
    fresh = _net()
    fresh[2].weight.data.zero_()
    load_trainable_state_dict(fresh, loaded)
    assert torch.equal(fresh[2].weight, model[2].weight)
    with pytest.raises(InputValueError, match=r"another frozen base \(0\.bias \(float32\[64\]\) holds other values\)"):
        load_trainable_state_dict(_net(seed=1), loaded)
    assert set(trainable_state_dict(_net(frozen=False))) == set(_net().state_dict())  # nothing frozen: all


def test_a_peft_models_folder_is_its_adapter_folder_from_a_checkpoint_without_the_base(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel

    from mixtrain.pretrained import export_pretrained, save_pretrained, spec_of
    from tests import lora

    model = lora.lora_model()
    spec = spec_of(model)
    assert spec is not None and spec.model_class.endswith(":GPT2LMHeadModel") and spec.peft_config is not None
    assert spec.peft_config["target_modules"] == ["c_attn", "c_fc", "c_proj"]  # a set, as JSON
    base = describe(model)
    assert base is not None
    adapters = trim(model.state_dict(), base)
    out = save_pretrained(adapters, spec, tmp_path / "hf_model")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    loaded = PeftModel.from_pretrained(lora.base(), out)
    for name, want in adapters.items():
        assert torch.equal(loaded.state_dict()[name], want), name
    # `mixtrain export` of a checkpoint that left the base out writes the same folder
    run_dir = tmp_path / "run"
    checkpoint = CheckpointStore(run_dir, base=base).save({"model": model.state_dict()}, _meta(2))
    (run_dir / "config.json").write_text(json.dumps({"hf_model": dataclasses.asdict(spec)}))
    exported = export_pretrained(checkpoint)
    again = PeftModel.from_pretrained(lora.base(), exported)
    for name, want in adapters.items():
        assert torch.equal(again.state_dict()[name], want), name
    # a plain Hugging Face model's checkpoint without its base cannot be a model folder: one line, the fix
    (run_dir / "config.json").write_text(json.dumps({"hf_model": {**dataclasses.asdict(spec), "peft_config": None}}))
    with pytest.raises(InputValueError, match="export the run folder"):
        export_pretrained(checkpoint)
