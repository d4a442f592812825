"""The whole from the slices: the model's state with the weights other ranks own left out and merged back in
(checkpoints, the final weights), and gradients clipped by the global norm (the owners' squared sums, summed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def clip_to(grads: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """Scale `grads` (this rank's part of a gradient whose global norm is `norm`) as torch's clip_grad_norm_ would."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)


def state_without(model: torch.nn.Module, foreign: Callable[[torch.Tensor], bool]) -> dict[str, Any]:
    """The model's state_dict with the weights `foreign` names as None (the driver fills them in)."""
    return {k: (None if foreign(t) else v) for k, (t, v) in _entries(model).items()}


def state_part(model: torch.nn.Module, owns: Callable[[torch.Tensor], bool]) -> dict[str, torch.Tensor]:
    """The weights `owns` names, by state_dict key."""
    return {k: v for k, (t, v) in _entries(model).items() if owns(t)}


def merge_weights(state: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A model_state() with every rank's model_part() filled in; every weight must have come from some owner."""
    for part in parts:
        state.update(part)
    missing = [k for k, v in state.items() if v is None]
    if missing:
        raise RuntimeError(f"the gathered weights lack {missing[:5]}: no worker owns them")
    return state


def _entries(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """state_dict key -> (the parameter or buffer itself, its state_dict value), without reading any weight."""
    objects: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        objects[name] = p
    for name, b in model.named_buffers(remove_duplicate=False):
        objects[name] = b
    return {k: (objects.get(k, v), v) for k, v in model.state_dict().items()}
