"""Which modules are the blocks gathered one at a time at shard="full": found by themselves, or named on a Task
(Task.shard_blocks) or on the loop's prepare_model(blocks=), by class or by class name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixtrain.errors import InputTypeError, InputValueError
from mixtrain.shard.blocks import block_name, find_blocks
from mixtrain.task import Task
from mixtrain.train._prepare import PreparedModel
from mixtrain.train._sliced_loop import check_shard


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _task(model: nn.Module, **kw) -> Task:
    return Task(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss(), **kw)


def test_blocks_are_found_or_named_by_class_or_by_name():
    net = Net()
    assert find_blocks(net) == list(net.blocks)
    mlps = [b.mlp for b in net.blocks]
    assert find_blocks(net, (nn.Sequential,)) == mlps
    assert find_blocks(net, ("Sequential",)) == mlps
    assert block_name((nn.Sequential,)) == block_name(("Sequential",)) == "Sequential"
    assert block_name(()) is None


def test_a_block_named_under_activation_checkpointing_is_its_recomputed_class():
    task = _task(Net(), activation_checkpointing=(Block,), shard_blocks=("Block",))
    found = find_blocks(task.model, task.shard_blocks)
    assert len(found) == 3 and all(isinstance(b, Block) for b in found)
    assert type(found[0]).__name__ == "RecomputedBlock"
    assert find_blocks(task.model, (Block,)) == found


def test_a_block_the_model_does_not_hold_is_refused_naming_its_classes():
    with pytest.raises(InputValueError, match=r"block='GPT2Block'.*its classes: Block, LayerNorm, Linear"):
        find_blocks(Net(), ("GPT2Block",))
    with pytest.raises(InputValueError, match=r"block=Conv2d: the model holds no module of that class"):
        find_blocks(Net(), (nn.Conv2d,))


@pytest.mark.parametrize("bad", ["Block", Block, (3,), (torch.Tensor,)])
def test_task_shard_blocks_takes_a_tuple_of_module_classes_or_names(bad):
    with pytest.raises(InputTypeError, match=r"Task.shard_blocks=.*a tuple of module classes or class names"):
        _task(Net(), shard_blocks=bad)


def test_a_task_naming_a_block_its_model_lacks_is_refused_when_made():
    with pytest.raises(InputValueError, match=r"Task.shard_blocks: block='GPT2Block': the model has no module class"):
        _task(Net(), shard_blocks=("GPT2Block",))


@pytest.mark.parametrize(
    "blocks,error",
    [(("GPT2Block",), r"prepare_model's blocks: block='GPT2Block': the model has no module class"),
     ("Block", r"prepare_model's blocks='Block': a tuple of module classes or class names")],
)  # fmt: skip
def test_the_loop_checks_named_blocks_in_its_own_words_on_one_worker_too(blocks, error):
    from tests.unit.test_loop_session import _session

    with pytest.raises((InputTypeError, InputValueError), match=error):
        PreparedModel(Net(), _session(), "full", None, blocks)
    assert PreparedModel(Net(), _session(), "full", None, [Block]).module is not None


def test_the_loop_takes_blocks_only_with_full_slicing():
    assert check_shard("full", None, 2, (Block,)) is None
    with pytest.raises(InputValueError, match=r"blocks name what shard='full' gathers.*give shard='full'"):
        check_shard("gradients", None, 2, (Block,))


@pytest.mark.parametrize(
    ("shard", "says"),
    [
        ("auto", r"shard='auto'.*'auto' is the Task path's.*mixtrain plan"),
        ("optimizer", r"shard='optimizer'.*'gradients' moves the same bytes"),
        ("Full", r"shard='Full'\): give 'none', 'gradients'"),
        (3, r"shard=3\): give 'none', 'gradients'"),
    ],
)
def test_the_loops_shard_level_refused_in_one_line_that_says_why(shard, says):
    with pytest.raises(InputValueError, match=says):
        check_shard(shard, None, 2)
