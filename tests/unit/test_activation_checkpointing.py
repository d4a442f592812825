"""Task.activation_checkpointing: the same gradients (dropout included) with fewer activations kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mixtrain import Task


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), nn.Linear(32, 5))


def _task(checkpointing: bool) -> Task:
    model = _model()
    types = (nn.TransformerEncoderLayer,) if checkpointing else ()
    return Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.mean(1), y),
        activation_checkpointing=types,
    )


def _grads_and_saved_bytes(task: Task) -> tuple[list[torch.Tensor], int]:
    """Gradients of one training step, and the bytes autograd kept for backward."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, 32), torch.randint(0, 5, (8,))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    task.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = task.batch_loss(task.model, (x, y))
    loss.backward()
    return [p.grad.clone() for p in task.model.parameters()], saved[0]


def test_recomputed_blocks_give_the_same_gradients_with_dropout_and_keep_fewer_activations():
    plain, kept = _grads_and_saved_bytes(_task(False))
    task = _task(True)
    recomputed, kept_less = _grads_and_saved_bytes(task)
    for a, b in zip(plain, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kept_less < kept / 2, (kept_less, kept)
    layers = [m for m in task.model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    assert len(layers) == 3 and all(type(m).__name__ == "RecomputedTransformerEncoderLayer" for m in layers)
    assert task.model.state_dict().keys() == _model().state_dict().keys()  # checkpoints load either way


def test_a_copy_of_a_recomputed_model_runs_on_its_own_weights_and_eval_keeps_nothing_extra():
    task = _task(True)
    twin = copy.deepcopy(task.model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(2, 4, 32)
    task.model.eval()
    twin.eval()
    assert not torch.equal(task.model(x), twin(x))


def test_checkpointing_a_module_type_the_model_lacks_or_a_non_module_is_a_clear_error():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"activation_checkpointing=\['Conv2d'\].*no such module.*Linear"):
        Task(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.mse_loss,
            activation_checkpointing=(nn.Conv2d,),
        )
    with pytest.raises(TypeError, match="give module classes"):
        Task(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=nn.functional.mse_loss,
            activation_checkpointing=("Linear",),  # type: ignore[arg-type]
        )
