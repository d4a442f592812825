"""A model's frozen base (its parameters with requires_grad=False: a LoRA run's pretrained weights) is not training
state: checkpoints keep only the trainable parameters (with the buffers, which training may change, and the
optimizer's state, which only trainable parameters have), and a fingerprint of the base instead of its bytes.

A resume builds the model from the job, base included, and loads the trainable part over it; a base that differs
from the one the checkpoint was trained on (its fingerprint: each frozen tensor's name, shape, dtype and bytes) is
refused in one line naming the first tensor that differs. The loop path's helpers (`trainable_state_dict`,
`load_trainable_state_dict`, in mixtrain.train.torch) use the same rule for a loop's own checkpoint files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from mixtrain.errors import InputValueError

MANIFEST_KEY = "frozen_base"
"""A checkpoint manifest's key for the fingerprint of the base it left out (absent: a whole checkpoint)."""
STATE_KEY = "mixtrain.frozen_base"
"""trainable_state_dict's entry (a JSON-clean dict) that load_trainable_state_dict checks the model against."""


@dataclass(frozen=True, kw_only=True)
class FrozenBase:
    """The frozen parameters of a model, by state-dict name (tied names each), without their bytes."""

    fingerprint: str
    """A digest of every frozen tensor's name, shape, dtype and bytes (comm.replicas.digest per tensor)."""
    tensors: dict[str, str]
    """Each frozen name -> "dtype[shape]:digest" (the digest's first 16 hex digits), to name what differs."""
    num_bytes: int
    """The frozen parameters' bytes (each stored tensor once): what a checkpoint no longer writes."""

    def manifest(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "tensors": self.tensors, "num_bytes": self.num_bytes}


def describe(model: torch.nn.Module) -> FrozenBase | None:
    """The frozen part of `model`; None when every parameter trains (nothing to leave out)."""
    from mixtrain.comm.replicas import digest

    frozen = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    if not frozen:
        return None
    tensors: dict[str, str] = {}
    whole = hashlib.blake2b(digest_size=16)
    seen: dict[int, str] = {}
    num_bytes = 0
    for name, p in sorted(frozen, key=lambda e: e[0]):
        if id(p) not in seen:  # a tied tensor is hashed (and counted) once
            seen[id(p)] = digest([p]).hex()
            num_bytes += p.numel() * p.element_size()
        kind = f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
        tensors[name] = f"{kind}:{seen[id(p)][:16]}"
        whole.update(f"{name}={kind}:{seen[id(p)]};".encode())
    return FrozenBase(fingerprint=whole.hexdigest(), tensors=tensors, num_bytes=num_bytes)


def trim(model_state: dict[str, Any], base: FrozenBase) -> dict[str, Any]:
    """`model_state` without the frozen parameters (buffers and trainable parameters stay)."""
    return {k: v for k, v in model_state.items() if k not in base.tensors}


def difference(saved: Any, current: FrozenBase | None) -> str | None:
    """What differs between the base a checkpoint was trained on (its manifest entry) and the model's base now, in
    a few words naming a tensor; None when they are the same."""
    if not isinstance(saved, dict) or not isinstance(saved.get("tensors"), dict):
        return "its frozen-base entry is malformed"
    if current is None:
        return "the model built now has no frozen parameters (every parameter trains)"
    if saved.get("fingerprint") == current.fingerprint:
        return None
    theirs: dict[str, Any] = saved["tensors"]
    for name in sorted(set(theirs) | set(current.tensors)):
        was, now = theirs.get(name), current.tensors.get(name)
        if was == now:
            continue
        if was is None:
            return f"{name} is frozen now but was not then"
        if now is None:
            return f"{name} was frozen then but is not now (or is gone)"
        was_kind, _, _ = str(was).partition(":")
        now_kind, _, _ = now.partition(":")
        if was_kind != now_kind:
            return f"{name} was {was_kind}, is {now_kind}"
        return f"{name} ({now_kind}) holds other values"
    return "the fingerprints differ"


def check_resume(manifest: dict[str, Any], current: FrozenBase | None, where: object) -> None:
    """InputValueError, one line, when the checkpoint at `where` left out a base other than the model's now."""
    if MANIFEST_KEY not in manifest:
        return  # a whole checkpoint: it carries its base
    why = difference(manifest[MANIFEST_KEY], current)
    if why is not None:
        raise InputValueError(
            f"resume: the checkpoint {where} holds only the trainable parameters of a model whose frozen base differs "
            f"from the one built now ({why}); build the same base (the same pretrained weights, dtype and frozen "
            "parameters) as the run that wrote it, or start a new run"
        )


def load_model_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """model.load_state_dict(state), strict, except that the model's frozen parameters may be absent (a checkpoint
    without its base): they keep what the model was built with."""
    missing = set(model.state_dict()) - set(state)
    if not missing:
        model.load_state_dict(state)
        return
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    absent = sorted(missing - frozen)
    if absent:
        raise InputValueError(
            f"the state to load lacks {len(absent)} tensor(s) the model trains or keeps, e.g. {absent[:3]}; load a "
            "checkpoint of this model (only frozen parameters may be left out)"
        )
    model.load_state_dict(state, strict=False)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """`model.state_dict()` without its frozen parameters, plus the base's fingerprint (STATE_KEY): what a loop
    saves for a LoRA model. load_trainable_state_dict checks the fingerprint and loads it back."""
    base = describe(model)
    state = model.state_dict()
    if base is None:
        return state
    return {**trim(state, base), STATE_KEY: base.manifest()}


def load_trainable_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load what trainable_state_dict saved into a model built with its base; another base is refused in one line."""
    state = dict(state)
    saved = state.pop(STATE_KEY, None)
    if saved is not None:
        why = difference(saved, describe(model))
        if why is not None:
            raise InputValueError(
                f"load_trainable_state_dict: the saved state was trained on another frozen base ({why}); build the "
                "model with the base it was trained on"
            )
    load_model_state(model, state)
