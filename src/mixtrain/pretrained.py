"""Weights Hugging Face users load as they load any model: when the task's model is a `transformers.PreTrainedModel`,
the final weights are also written with `save_pretrained` into RUN_DIR/hf_model (Result.hf_model_path), which
`AutoModelForCausalLM.from_pretrained` (or the model's own class) loads; `export_pretrained` does the same for a
checkpoint or a run folder (`mixtrain export`).

The model lives on the workers; the driver has its state dict. So each worker says at bring-up which class it built
and with what config (HFModelSpec, rank 0's is kept, and written into the run's config.json); the driver rebuilds
the model from them (no weights are downloaded: `from_pretrained` gets the config and the state dict), checks that
every tensor came in unchanged, and writes the folder itself, as workers may be on other hosts."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixtrain._files import RunFolder
from mixtrain.errors import InputValueError, require

HF_MODEL = "hf_model"
"""The folder in the run folder with the final weights as `save_pretrained` writes them."""
CONFIG_KEY = "hf_model"
"""The key of config.json (the run's) that holds the HFModelSpec, for exporting its checkpoints later."""


@dataclass(frozen=True, kw_only=True)
class HFModelSpec:
    """What rebuilds a Hugging Face model around its state dict on the driver (mixtrain.pretrained)."""

    model_class: str
    """The class a worker built, as "module:QualifiedName", e.g.
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"."""
    config: dict[str, Any]
    """Its config, as `model.config.to_json_string()` writes it."""
    peft_config: dict[str, Any] | None = None
    """For a `peft` model (a LoRA adapter around the model of `model_class`): its adapter's config, as JSON; the
    run's hf_model folder is then the adapter folder that `peft.PeftModel.from_pretrained(base, folder)` loads."""


def spec_of(model: torch.nn.Module) -> HFModelSpec | None:
    """On a worker: the class and config of a Hugging Face model (of the base and its adapter's config, for a `peft`
    model around one), or None for any other model. transformers and peft are never imported for this: a model
    of theirs means they are imported already."""
    peft = sys.modules.get("peft")
    peft_config = None
    if peft is not None and isinstance(model, peft.PeftModel):
        peft_config = _json_clean(model.peft_config[model.active_adapter].to_dict())
        model = model.get_base_model()
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return None
    cls = type(model)
    config = json.loads(model.config.to_json_string(use_diff=False))  # JSON-clean (dtypes as names)
    return HFModelSpec(model_class=f"{cls.__module__}:{cls.__qualname__}", config=config, peft_config=peft_config)


def _json_clean(value: Any) -> Any:
    """A peft config's dict as JSON values: its sets (target_modules) become sorted lists, enums their names."""
    return json.loads(json.dumps(value, default=lambda v: sorted(v) if isinstance(v, set | frozenset) else str(v)))


def save_pretrained(
    state_dict: dict[str, Any], spec: HFModelSpec, out_dir: str | Path, *, import_module: bool = False
) -> Path:
    """Rebuild `spec`'s model around `state_dict` (every tensor must load, unchanged) and write it with
    save_pretrained into `out_dir`, atomically: a folder that was there is replaced only once the new one is whole.
    `import_module`: import the class's module when it is not imported yet (a spec from this run's workers); a spec
    read from a file names only an imported module or one of transformers', so a run folder cannot make this
    process import code of its choosing."""
    require("transformers", "transformers", "hf", "writing a Hugging Face model folder")
    build = _rebuild if spec.peft_config is None else _adapters
    model = build(state_dict, spec, import_module)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{secrets.token_hex(4)}")
    aside = out.with_name(f".tmp-{out.name}-old-{secrets.token_hex(4)}")
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp)
        if os.path.lexists(out):
            os.rename(out, aside)
        os.rename(tmp, out)
    finally:
        for leftover in (tmp, aside):
            if os.path.lexists(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
    return out


def _private(folder: Path) -> Path:
    """The run folder's modes on a folder transformers wrote with the umask's: folders 0700, files 0600 (links,
    none of its own, are left alone: chmod would follow them)."""
    for where, dirs, files in os.walk(folder):
        for name in [*dirs, *files, ""]:
            path = os.path.join(where, name) if name else where
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
                os.chmod(path, 0o700 if stat.S_ISDIR(mode) else 0o600)
    return folder


def save_final_hf_model(
    state_dict: dict[str, Any],
    spec: HFModelSpec | None,
    run_dir: Path,
    say: Callable[[str], None],
    name: str = HF_MODEL,
) -> Path | None:
    """RUN_DIR/`name` (hf_model: the final weights; hf_best for the best checkpoint's) for a Hugging Face model, None
    for any other. A failure is said, not raised: the weights are in the run folder already, and `mixtrain export`
    writes the folder later."""
    if spec is None:
        return None
    try:
        path = _private(save_pretrained(state_dict, spec, run_dir / name, import_module=True))
    except Exception as exc:
        say(f"could not write the Hugging Face folder {run_dir / name}: {exc} (the weights are in the run folder: "
            "`mixtrain export RUN_DIR`, or `mixtrain export CHECKPOINT --out DIR`, tries again)")  # fmt: skip
        return None
    loads = "peft.PeftModel.from_pretrained(base, folder)" if spec.peft_config else "AutoModel.from_pretrained"
    say(f"done: Hugging Face {'adapter' if spec.peft_config else 'model'} in {path} ({loads} reads it)")
    return path


def export_pretrained(source: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the weights of a run folder (its final weights) or of one of its checkpoints (a folder under
    RUN_DIR/checkpoints) as a Hugging Face model folder; returns the folder. The model's class and config come
    from the run's config.json. `out_dir` defaults to RUN_DIR/hf_model for a run folder and to
    RUN_DIR/hf_<checkpoint name> for a checkpoint."""
    from mixtrain.checkpoint import FROZEN_BASE, MANIFEST, CheckpointStore, load_weights

    path = Path(source)
    if (path / MANIFEST).is_file():  # a checkpoint: RUN_DIR/checkpoints/step-N
        run_dir, default = path.parent.parent, path.parent.parent / f"hf_{path.name}"
        state, manifest = CheckpointStore.read(path)  # verified against its manifest
        state_dict = state["model"]
        if FROZEN_BASE in manifest and read_spec(run_dir).peft_config is None:
            raise InputValueError(
                f"export: the checkpoint {path} holds only the trainable parameters (its frozen base was left out), "
                f"and the model is no peft adapter; export the run folder {run_dir} (its model.safetensors holds "
                "the whole model) instead"
            )
    elif (path / "model.safetensors").is_file() or (path / "model.pt").is_file():
        run_dir, default = path, path / HF_MODEL
        state_dict = load_weights(path)
    else:
        raise InputValueError(
            f"export: {str(source)!r} is neither a run folder (with model.safetensors) nor a checkpoint folder (with "
            f"{MANIFEST}); give one of them"
        )
    if out_dir is None:  # RUN_DIR/hf_model or hf_step-N: mixtrain's own folder in the run, replaced whole
        return save_pretrained(state_dict, read_spec(run_dir), default)
    from mixtrain.export_folder import check_out, place_export

    out = Path(out_dir)
    previous = check_out(out, run_dir)  # before anything is written: a folder that is not ours is one line
    tmp = out.with_name(f".tmp-{out.name}-{secrets.token_hex(4)}")
    try:
        save_pretrained(state_dict, read_spec(run_dir), tmp)
        place_export(tmp, out, previous)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_spec(run_dir: Path) -> HFModelSpec:
    """The HFModelSpec the run wrote into its config.json; a run of another model has none."""
    try:
        with RunFolder(run_dir) as folder:
            config = folder.read_json("config.json")
    except (OSError, ValueError) as exc:
        raise InputValueError(
            f"export: cannot read {run_dir / 'config.json'} ({exc}); is {run_dir} a run folder?"
        ) from None
    entry = config.get(CONFIG_KEY) if isinstance(config, dict) else None
    if not (
        isinstance(entry, dict) and isinstance(entry.get("model_class"), str) and isinstance(entry.get("config"), dict)
    ):
        raise InputValueError(
            f"export: the run in {run_dir} did not train a Hugging Face transformers.PreTrainedModel (its config.json "
            f"has no {CONFIG_KEY!r} entry), so there is no class and config to rebuild it from; load its weights with "
            "mixtrain.load_weights into your own model instead"
        )
    peft_config = entry.get("peft_config")
    return HFModelSpec(
        model_class=entry["model_class"],
        config=entry["config"],
        peft_config=peft_config if isinstance(peft_config, dict) else None,
    )


def _rebuild(state_dict: dict[str, Any], spec: HFModelSpec, import_module: bool) -> Any:
    """The model of `spec` holding `state_dict`, checked tensor by tensor."""
    from transformers import PreTrainedModel

    cls: Any = _model_class(spec.model_class, import_module)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise InputValueError(
            f"model_class={spec.model_class!r} is not a transformers.PreTrainedModel subclass: only those are written "
            "with save_pretrained"
        )
    config_class: Any = cls.config_class
    if config_class is None:
        raise InputValueError(f"model_class={spec.model_class!r} has no config_class to build its config from")
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    with _quiet_transformers():  # no weights are downloaded: from the config and the state dict only
        config = config_class.from_dict(spec.config)
        loaded: Any = cls.from_pretrained(None, config=config, state_dict=tensors, output_loading_info=True)
    model, info = loaded
    model.tie_weights()  # loading a state dict may leave tied tensors apart; save_pretrained writes one of them
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1 and model.dtype not in dtypes:  # a model trained in bf16 stays bf16
        model.to(dtypes.pop())
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    theirs = model.state_dict()
    changed = [k for k, t in tensors.items() if k in theirs and not torch.equal(theirs[k].cpu(), t.cpu())]
    if problems or info.get("error_msgs") or changed:
        raise InputValueError(
            f"the weights do not fit {spec.model_class} built from its config: {problems or ''} "
            f"{info.get('error_msgs') or ''} {('changed on loading: ' + str(changed[:5])) if changed else ''}".strip()
        )
    return model


def _adapters(state_dict: dict[str, Any], spec: HFModelSpec, import_module: bool) -> Any:
    """The `peft` model of `spec` holding the trained adapters of `state_dict` (a checkpoint's, without the base,
    or the whole final state), for its own save_pretrained, which writes only the adapters and their config. The
    base is built on the meta device: no memory for it, no weights downloaded, none needed to save adapters."""
    require("peft", "peft", "lora", "writing a LoRA adapter folder")
    import peft

    cls: Any = _model_class(spec.model_class, import_module)
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    with _quiet_transformers(), torch.device("meta"):
        base = cls(cls.config_class.from_dict(spec.config))
        model: Any = peft.get_peft_model(base, peft.get_peft_config(dict(spec.peft_config or {})))
    wanted = {n for n, p in model.named_parameters() if p.requires_grad}
    lacking = sorted(wanted - set(tensors))
    result = model.load_state_dict({k: v for k, v in tensors.items() if k in wanted}, strict=False, assign=True)
    if lacking or result.unexpected_keys:
        raise InputValueError(
            f"the weights do not hold the adapters of {spec.model_class} with this peft config: lacking "
            f"{lacking[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
        )
    return model


def _model_class(name: str, import_module: bool) -> Any:
    module_name, _, qualname = name.partition(":")
    if not qualname:
        raise InputValueError(f"model_class={name!r}: expected 'module:QualifiedName'")
    allowed = import_module or module_name in sys.modules or module_name.split(".")[0] == "transformers"
    if not allowed:
        raise InputValueError(
            f"model_class={name!r}: its module {module_name!r} is not imported, and a run folder's file does not get "
            f"to import code; import {module_name} first (then export again)"
        )
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars or config warnings from transformers while mixtrain rebuilds and writes a model; the
    user's settings come back after."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
