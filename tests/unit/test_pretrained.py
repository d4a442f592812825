"""Hugging Face folders from a state dict, without Ray: what a worker reports of its model, the driver's rebuild and
save_pretrained (tied weights included, every tensor checked), export from a run folder or a checkpoint (API and
CLI), and the README's two lines that load model.safetensors into a fresh model. tests/ray/test_training_code.py
checks the same on a real run."""

import json

import pytest
import torch

import mixtrain
from mixtrain.checkpoint import CheckpointStore, save_weights
from mixtrain.pretrained import HF_MODEL, HFModelSpec, export_pretrained, save_pretrained, spec_of

transformers = pytest.importorskip("transformers")


def _gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _trained() -> torch.nn.Module:
    """A few AdamW steps: weights away from their initial values (and the tied ones still tied)."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return model


def _assert_same(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    mine = model.state_dict()
    assert set(state_dict) <= set(mine)
    for key, want in state_dict.items():
        assert torch.equal(mine[key], want), key


def test_a_worker_reports_a_hugging_face_models_class_and_config_and_nothing_for_others():
    spec = spec_of(_gpt2())
    assert spec is not None
    assert spec.model_class == "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"
    assert spec.config["n_embd"] == 32 and spec.config["vocab_size"] == 40
    json.dumps(spec.config)  # it goes into config.json
    assert spec_of(torch.nn.Linear(2, 2)) is None


def test_the_folder_loads_with_auto_model_and_holds_the_trained_weights_tied(tmp_path):
    model = _trained()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # apart, as the driver receives them
    spec = spec_of(model)
    assert spec is not None
    out = save_pretrained(state, spec, tmp_path / HF_MODEL)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.GPT2LMHeadModel
    _assert_same(loaded, state)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    save_pretrained(state, spec, out)  # written again: replaced whole, nothing left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [HF_MODEL]


def test_weights_that_do_not_fit_the_model_are_refused_naming_them(tmp_path):
    model = _trained()
    spec = spec_of(model)
    assert spec is not None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    untied = {**state, "lm_head.weight": state["lm_head.weight"] + 1}  # the model ties it to wte: it would be lost
    with pytest.raises(ValueError, match=r"changed on loading: \[.*(lm_head|wte)"):
        save_pretrained(untied, spec, tmp_path / "a")
    missing = {k: v for k, v in state.items() if k != "transformer.h.0.mlp.c_fc.weight"}
    with pytest.raises(ValueError, match=r"missing_keys.*transformer\.h\.0\.mlp\.c_fc\.weight"):
        save_pretrained(missing, spec, tmp_path / "b")
    with pytest.raises(ValueError, match=r"is not a transformers\.PreTrainedModel subclass"):
        save_pretrained(state, HFModelSpec(model_class="torch.nn:Linear", config={}), tmp_path / "c")
    stranger = HFModelSpec(model_class="some_module_nobody_imported:Model", config={})
    with pytest.raises(ValueError, match="its module 'some_module_nobody_imported' is not imported"):
        save_pretrained(state, stranger, tmp_path / "d")
    assert not any(tmp_path.iterdir())  # nothing half-written


def _a_run_folder(tmp_path, model):
    """What a run of `model` leaves: config.json with its spec, model.safetensors, one checkpoint."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = spec_of(model)
    assert spec is not None
    (run_dir / "config.json").write_text(
        json.dumps({"hf_model": {"model_class": spec.model_class, "config": spec.config}})
    )
    save_weights(model.state_dict(), run_dir / "model.safetensors")
    early = {k: v + 0.5 for k, v in model.state_dict().items()}
    meta = {"epoch": 0, "step": 3, "global_step": 3, "shares": [8], "num_workers": 1, "workers": []}
    checkpoint = CheckpointStore(run_dir).save({"model": early, "optimizer": {}}, meta)
    return run_dir, checkpoint, early


def test_export_writes_a_run_folders_or_a_checkpoints_weights(tmp_path):
    model = _trained()
    run_dir, checkpoint, early = _a_run_folder(tmp_path, model)
    final = export_pretrained(run_dir)
    assert final == run_dir / HF_MODEL
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(final), model.state_dict())
    best = mixtrain.export_pretrained(checkpoint, run_dir / "hf_best")
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(best), early)
    assert export_pretrained(checkpoint) == run_dir / f"hf_{checkpoint.name}"
    (run_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"did not train a Hugging Face transformers\.PreTrainedModel"):
        export_pretrained(run_dir)
    with pytest.raises(ValueError, match="is neither a run folder"):
        export_pretrained(tmp_path)


def test_the_export_command(tmp_path, capsys):
    from mixtrain.cli.main import main

    _, checkpoint, early = _a_run_folder(tmp_path, _trained())
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'out'}"
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out"), early)
    assert main(["export", str(tmp_path)]) == 2  # bad input: one line, no traceback
    assert "mixtrain: error: export:" in capsys.readouterr().err


def test_the_readmes_two_lines_load_the_weights_file_into_a_fresh_model(tmp_path):
    trained = _trained()
    model_path = save_weights(trained.state_dict(), tmp_path / "model.safetensors")  # as Result.model_path
    model = _gpt2(seed=5)  # a fresh model, as the task factory builds it
    model.load_state_dict(mixtrain.load_weights(model_path))
    _assert_same(model, trained.state_dict())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied


def test_at_the_end_of_fit_a_folder_that_cannot_be_written_is_said_not_raised(tmp_path):
    from mixtrain.pretrained import save_final_hf_model

    model = _trained()
    said: list[str] = []
    assert save_final_hf_model(model.state_dict(), None, tmp_path, said.append) is None  # not a Hugging Face model
    gone = HFModelSpec(model_class="a_module_that_is_not_there:Model", config={})
    assert save_final_hf_model(model.state_dict(), gone, tmp_path, said.append) is None
    assert len(said) == 1 and said[0].startswith(f"could not write the Hugging Face folder {tmp_path / HF_MODEL}: ")
    spec = spec_of(model)
    assert save_final_hf_model(model.state_dict(), spec, tmp_path, said.append, "hf_best") == tmp_path / "hf_best"
    assert said[-1] == f"done: Hugging Face model in {tmp_path / 'hf_best'} (AutoModel.from_pretrained reads it)"


# ---- issue 46: an export deletes nothing it did not write ---------------------------------------------------------


def test_export_out_keeps_what_it_did_not_write_and_replaces_only_its_own_files(tmp_path):
    from mixtrain.export_folder import EXPORT_MARKER

    model = _trained()
    run_dir, checkpoint, early = _a_run_folder(tmp_path, model)
    out = tmp_path / "mymodels"
    (out / "other_model").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files mixtrain did not write \(notes.txt, other_model\)"):
        export_pretrained(run_dir, out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "other_model").is_dir()
    export_pretrained(run_dir, tmp_path / "empty")  # a new folder
    (tmp_path / "was_empty").mkdir()
    export_pretrained(checkpoint, tmp_path / "was_empty")  # an empty one
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "was_empty"), early)
    written = json.loads((tmp_path / "was_empty" / EXPORT_MARKER).read_text())
    assert "config.json" in written and EXPORT_MARKER not in written
    (tmp_path / "was_empty" / "README.md").write_text("my notes")  # added by hand after the export
    export_pretrained(run_dir, tmp_path / "was_empty")  # again over it: its own files replaced, the README kept
    _assert_same(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "was_empty"), model.state_dict())
    assert (tmp_path / "was_empty" / "README.md").read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("out", [".", "run", "elsewhere"])
def test_export_out_into_the_current_or_a_run_folder_is_one_line(tmp_path, monkeypatch, out):
    import subprocess
    import sys
    from pathlib import Path

    _a_run_folder(tmp_path, _trained())
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metrics.jsonl").write_text("")  # another run's folder
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mixtrain"), "export", "run", "--out", out],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert ("is the current folder" if out == "." else "is a run folder") in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_the_run_folders_hugging_face_folder_is_private_and_a_link_planted_there_is_not_written_through(tmp_path):
    import os
    import stat

    from mixtrain.pretrained import save_final_hf_model

    model = _trained()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / HF_MODEL).symlink_to(elsewhere)
    path = save_final_hf_model(model.state_dict(), spec_of(model), run, lambda _m: None)
    assert path == run / HF_MODEL and not path.is_symlink() and os.listdir(elsewhere) == []
    modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in [path, *path.iterdir()]}
    assert modes.pop(HF_MODEL) == 0o700 and set(modes.values()) == {0o600}, modes
