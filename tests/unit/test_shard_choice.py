"""ScalingConfig(shard="auto") (issue 48): the lowest slicing level whose training state fits every worker's memory,
by the what-if plan's own rule of what a level holds; each worker's memory from its group's cap or its device's free
memory; a clear refusal where nothing fits. Ray-free."""

import pytest
import torch

from mixtrain.cli.main import build_parser
from mixtrain.config import DeviceGroup, ScalingConfig
from mixtrain.errors import InputValueError
from mixtrain.policies.memory_plan import MIB, PROCESS_BYTES, Device, plan_memory
from mixtrain.policies.model_shape import ModelShape, expected_optimizer_bytes, measure_shape, state_shape
from mixtrain.policies.shard_choice import Seen, WorkerMemory, choose_shard, resolve, weigh, worker_memories
from mixtrain.train.torch import TorchTrainer
from tests.models import mlp

SHAPE = ModelShape(  # six blocks of 90 MiB and 60 MiB outside them, AdamW's two moments
    num_parameters=600 * MIB // 4,
    trainable_bytes=600 * MIB,
    frozen_bytes=0,
    optimizer_bytes=1200 * MIB,
    block_name="Block",
    num_blocks=6,
    block_bytes=90 * MIB,
    block_frozen_bytes=0.0,
    root_bytes=60 * MIB,
    activation_per_sample=(0.0, 0.0),
    activation_fixed=(0.0, 0.0),
    flops_per_sample=(0.0, 0.0),
)
# the state per worker on two equal workers (halves), in MiB, by memory_plan's rule:
#   none       600 + 600 + 1200                        = 2400
#   optimizer  600 + 600 + 1200/2 + 16 (a broadcast piece) = 1816
#   gradients  600 + (300 + 90) + 600                  = 1590
#   full       300 + 60 + 2 x 90 + (300 + 90) + 600    = 1530


def free(*mib: float, kind: str = "cpu") -> list[WorkerMemory]:
    """Workers with this much free memory each (the process's own bytes already spent)."""
    return [WorkerMemory(f"worker {r}", kind, int(m * MIB), given=False, host="h") for r, m in enumerate(mib)]


@pytest.mark.parametrize(
    ("room_mib", "level"),
    [(3000, "none"), (2400, "none"), (2000, "optimizer"), (1700, "gradients"), (1550, "full")],
)
def test_the_lowest_level_whose_state_fits_every_worker_is_chosen(room_mib, level):
    choice = choose_shard(SHAPE, free(room_mib, room_mib))
    assert choice.level == level
    assert choice.line.startswith(f"shard auto: {level}, the lowest level whose training state fits every worker")
    assert [t.level for t in choice.tried][-1] == level and choice.tried[-1].fits
    assert not any(t.fits for t in choice.tried[:-1])


def test_one_small_worker_forces_slicing_and_the_slices_follow_memory():
    """10 GiB and 2000 MiB free: whole, 2400 MiB does not fit the small one; sliced by memory (0.84 : 0.16) its
    optimizer state shrinks to 196 MiB, so "optimizer" fits both."""
    choice = choose_shard(SHAPE, free(10240, 2000))
    assert choice.level == "optimizer" and choice.slices == (10240 * MIB, 2000 * MIB)
    none, optimizer = choice.tried
    assert none.needs == (2400 * MIB, 2400 * MIB) and none.tightest == 1
    assert optimizer.needs[1] == pytest.approx((1200 + 1200 * 2000 / 12240 + 16) * MIB)
    assert "; lower levels do not: none needs 2.34 GiB of worker 1's 1.95 GiB (memory: free" in choice.line
    assert "worker 1 (cpu on h) needs 1.38 GiB of its 1.95 GiB, the tightest" in choice.line
    # the user's slices, not the memory, size them where given: with halves 1816 MiB is too much for 1700
    assert choose_shard(SHAPE, free(10240, 1700)).level == "optimizer"
    assert choose_shard(SHAPE, free(10240, 1700), slices=[1, 1]).level == "gradients"


def test_a_cap_counts_the_process_and_free_memory_does_not():
    need = 1590 * MIB  # "gradients", both halves
    capped = [WorkerMemory(f"worker {r}", "cpu", PROCESS_BYTES["cpu"] + need, given=True) for r in (0, 1)]
    assert choose_shard(SHAPE, capped).level == "gradients"
    assert "DeviceGroup.memory, less each process's own" in choose_shard(SHAPE, capped).line
    short = [WorkerMemory(w.name, "cpu", w.memory_bytes - 1, given=True) for w in capped]
    assert choose_shard(SHAPE, short).level == "full"
    assert choose_shard(SHAPE, free(1590, 1590)).level == "gradients"  # free memory: the process is already there


def test_offloading_the_optimizer_needs_a_slice_and_frees_a_card_of_its_state():
    cards = free(1560, 1560, kind="cuda")  # 2400 whole; 1200 + 16 at "optimizer" with its state on the host
    assert choose_shard(SHAPE, cards).level == "full"
    assert choose_shard(SHAPE, cards, offload=True).level == "optimizer"
    assert choose_shard(SHAPE, free(9000, 9000, kind="cuda"), offload=True).level == "optimizer"  # never "none"
    with pytest.raises(InputValueError):  # on a CPU the host's memory is the device's: offloading frees nothing
        choose_shard(SHAPE, free(1300, 1300), offload=True)


def test_where_nothing_fits_the_error_names_the_field_the_worker_its_memory_the_need_and_the_fix():
    with pytest.raises(InputValueError) as err:
        choose_shard(SHAPE, free(1100, 1000))
    message = str(err.value)
    assert message.startswith("ScalingConfig.shard='auto': no level's training state fits every worker")
    assert "worker 1 (cpu on h), which has 1000 MiB for it" in message
    assert "the nearest, 'full', needs" in message and "more memory" in message and "a smaller model" in message
    # one worker: slicing over one saves nothing (each level holds at least what "none" does)
    with pytest.raises(InputValueError, match=r"the nearest, 'none', needs 2\.34 GiB on worker 0"):
        choose_shard(SHAPE, free(2000))


def test_the_needs_are_the_what_if_plans_holdings_without_the_process_and_activations():
    """One rule for what a level holds: memory_plan.holding, the figures `mixtrain plan --devices` shows."""
    devices = [Device("cpu", 3 * 2**30), Device("cpu", 1 * 2**30)]
    workers = [WorkerMemory(f"worker {r}", "cpu", d.memory_bytes, given=True) for r, d in enumerate(devices)]
    plan = plan_memory(SHAPE, devices, 1.25e8, 8)
    for option in (o for o in plan.options if len(o.devices) == 2):
        weighed = weigh(SHAPE, option.level, workers, [3, 1], option.offload)
        for need, held in zip(weighed.needs, option.devices, strict=True):
            assert need == pytest.approx(held.total - held.parts["process"] - held.parts["activations"])


def test_workers_sharing_a_device_split_its_free_memory_and_caps_go_by_starting_rank():
    seen = [
        Seen(0, "a", "cpu", "", 8 * 2**30),
        Seen(1, "a", "cpu", "", 6 * 2**30),  # measured after its neighbour built: the larger figure is the host's
        Seen(2, "a", "cuda", "GPU-1", 12 * 2**30),
        Seen(3, "a", "cuda", "GPU-1", 12 * 2**30),  # half a card each
        Seen(4, "a", "cuda", "GPU-2", 24 * 2**30),
        Seen(5, "b", "cpu", "", 2 * 2**30),
        Seen(6, "a", "cuda", "", 4 * 2**30),  # a card that gives no identity is the worker's own
        Seen(7, "a", "cuda", "", 4 * 2**30),
    ]
    memories = worker_memories(seen, None)
    assert [w.memory_bytes // 2**30 for w in memories] == [4, 4, 6, 6, 24, 2, 4, 4]
    assert memories[5].label == "worker 5 (cpu on b)" and not any(w.given for w in memories)
    capped = worker_memories([Seen(2, "a", "cpu", "", None), Seen(0, "b", "cpu", "", None)], [10, 20, 30])
    assert [(w.memory_bytes, w.given) for w in capped] == [(30, True), (10, True)]
    with pytest.raises(InputValueError, match=r"shard='auto': worker 1 \(mps on b\) cannot tell its free memory"):
        worker_memories([Seen(0, "a", "cpu", "", 10), Seen(1, "b", "mps", "", None)], None)


def test_resolve_gives_the_level_to_the_config_and_the_slices_it_assumed():
    seen = [Seen(0, "a", "cpu", "", 10240 * MIB), Seen(1, "b", "cpu", "", 1700 * MIB)]
    scaling, choice = resolve(ScalingConfig(num_workers=2, shard="auto"), SHAPE, seen)
    assert (scaling.shard, choice.level) == ("optimizer", "optimizer")
    assert scaling.shard_slices == [10240 * MIB, 1700 * MIB]  # the engine slices as the choice assumed
    assert choice.record()["level"] == "optimizer" and choice.record()["need_bytes"]["none"] == [2400 * MIB] * 2
    roomy = [Seen(0, "a", "cpu", "", 2**40), Seen(1, "b", "cpu", "", 2**40)]
    scaling, _ = resolve(ScalingConfig(num_workers=2, shard="auto"), SHAPE, roomy)
    assert (scaling.shard, scaling.shard_slices) == ("none", None)
    given = ScalingConfig(num_workers=2, shard="auto", shard_slices=[1, 1])
    assert resolve(given, SHAPE, seen)[0].shard_slices == [1, 1] and resolve(given, SHAPE, seen)[1].level == "gradients"
    groups = [DeviceGroup(num_workers=1, memory=PROCESS_BYTES["cpu"] + 1600 * MIB) for _ in range(2)]
    scaling, choice = resolve(
        ScalingConfig(groups=groups, shard="auto"), SHAPE, [s._replace(free_memory=None) for s in seen]
    )
    assert (scaling.shard, scaling.shard_slices) == ("gradients", None)  # sliced by the caps, as the engine does


def test_the_state_is_read_from_the_built_model_without_running_it():
    model = mlp()
    for optimizer, per_weight in [
        (torch.optim.AdamW(model.parameters()), 2),
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 1),
        (torch.optim.SGD(model.parameters(), lr=0.1), 0),
        (torch.optim.Adam(model.parameters(), amsgrad=True), 3),
        (torch.optim.RMSprop(model.parameters(), momentum=0.5, centered=True), 3),
        (torch.optim.Adadelta(model.parameters()), 2),  # a class not in the table: AdamW's 2x, assumed
    ]:
        shape = state_shape(model, optimizer)
        measured = measure_shape(model, optimizer, lambda m, b: m(torch.randn(b, 20)).sum())
        assert shape.optimizer_bytes == per_weight * shape.trainable_bytes == expected_optimizer_bytes(optimizer)
        assert abs(measured.optimizer_bytes - shape.optimizer_bytes) <= 4 * 6  # a step counter per tensor at most
        for name in ("trainable_bytes", "frozen_bytes", "block_name", "num_blocks", "block_bytes", "root_bytes"):
            assert getattr(shape, name) == getattr(measured, name), name
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 20)).sum().backward()
    optimizer.step()  # state there already (a resume loaded it): what it holds
    assert expected_optimizer_bytes(optimizer) == state_shape(model, optimizer).trainable_bytes


def test_auto_is_a_choice_of_the_config_and_the_flag_and_a_loop_still_refuses_it():
    assert ScalingConfig(num_workers=2, shard="auto").shard == "auto"
    args = build_parser().parse_args(["train", "digits", "--shard", "auto"])
    assert args.shard == "auto"
    with pytest.raises(InputValueError, match=r"ScalingConfig.shard='auto' with a training loop.*prepare_model"):
        TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=2, shard="auto"))
