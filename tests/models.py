"""Task factories shared by the tests. Importable on Ray workers (the conftest puts the repo on PYTHONPATH)."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from mixtrain import Task


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def wide() -> nn.Module:
    """106k parameters: each of two parameter-server slices (213 KB) travels through Ray's object store, not
    inline in the call (Ray inlines objects up to 100 KB)."""
    return nn.Sequential(nn.Linear(20, 4096), nn.Tanh(), nn.Linear(4096, 5))


MODELS = {"mlp": mlp, "cnn": cnn, "bn": bn_net, "wide": wide}


def optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "sgd0":  # no momentum: local SGD with H=1 and a plain outer step is then exactly this
        return torch.optim.SGD(params, lr=0.1)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "frozen":  # learns nothing: a held-out metric that never improves
        return torch.optim.SGD(params, lr=0.0)
    raise ValueError(name)


def make_task(model: str, opt: str) -> Task:
    m = MODELS[model]()
    return Task(model=m, optimizer=optimizer(opt, m.parameters()), loss_fn=nn.functional.cross_entropy)


def factory(model: str, opt: str) -> Callable[[], Task]:
    return functools.partial(make_task, model, opt)


def _task_from_module(folder: str, name: str) -> Task:
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name).make_task()


def from_module(folder: str, name: str) -> Callable[[], Task]:
    """A factory that imports the user's module `name` from `folder` on the worker and calls its make_task()."""
    return functools.partial(_task_from_module, folder, name)


def raising_factory() -> Task:
    raise RuntimeError("boom from the user's factory")


def data(model: str, num_samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_samples, 1, 8, 8) if model == "cnn" else (num_samples, 20)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 5, (num_samples,), generator=g)
    return x, y


def _wait_for(path: str, timeout_s: float = 120.0) -> None:
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _inject(fault: str, loss: torch.Tensor, marker: str) -> torch.Tensor:
    """NaN from now on, or (once per marker file) SIGKILL / SIGSTOP this process."""
    import os
    import signal

    if fault == "nan":
        return loss * float("nan")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    return loss


def _out_of_memory_above(limit: int, loss: torch.Tensor, samples: int) -> torch.Tensor:
    if samples > limit:
        raise MemoryError(f"emulated: a micro-batch of {samples} samples does not fit (at most {limit})")
    return loss


def faulty_task(
    model: str,
    opt: str,
    fault: str,
    rank: int,
    at_call: int,
    marker: str,
    sleep_s: float = 0.0,
    replacement_for: int = 0,
    sleep_per_sample_s: float = 0.0,
    replacement_wait_s: float = 120.0,
) -> Task:
    """make_task(model, opt) whose loss injects a REAL fault on worker `rank` at its `at_call`-th training
    loss (counted once the collective group exists, so the start-up probe does not count):
    "kill" SIGKILLs its own process, "stop" SIGSTOPs it (a laptop asleep), once per `marker` file;
    "nan" makes its loss NaN from then on; "oom" raises MemoryError (the CPU's out-of-memory error) for every
    micro-batch larger than `at_call` samples; rank -1 injects nothing. `sleep_s`: every training loss on
    every worker sleeps that long, plus `sleep_per_sample_s` per sample (compute that scales with the
    share: two workers then really are twice as fast as one). `replacement_for` (the full group's size): in
    a group smaller than that, training losses wait until a replacement process has built its replica (it
    marks `marker`.replacement), so the replacement joins at the next round boundary however long it takes;
    at most `replacement_wait_s` per loss (rounds still end, so a replacement that failed is started again)."""
    import os
    import time

    import torch.distributed as dist

    task = make_task(model, opt)
    calls = [0]
    replacement = marker + ".replacement"
    if replacement_for and os.path.exists(marker):  # built after the fault: this is the replacement
        open(replacement, "w").close()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(out, target)
        if not dist.is_initialized():
            return loss
        if sleep_s or sleep_per_sample_s:
            time.sleep(sleep_s + sleep_per_sample_s * len(target))
        if dist.get_world_size() < replacement_for:
            _wait_for(replacement, replacement_wait_s)
        if dist.get_rank() != rank:
            return loss
        if fault == "oom":
            return _out_of_memory_above(at_call, loss, len(target))
        calls[0] += 1
        return _inject(fault, loss, marker) if calls[0] >= at_call else loss

    return Task(model=task.model, optimizer=task.optimizer, loss_fn=loss_fn)


def with_a_slow_first_step(make: Callable[[], Task], rank: int, seconds: float) -> Task:
    """make()'s task, whose worker `rank` sleeps `seconds` in its first training loss (a process that a
    loaded machine starts late): it reaches the step's collective after its peers have."""
    import time

    import torch.distributed as dist

    task = make()
    inner, first = task.loss_fn, [True]
    assert inner is not None, "a task with a loss_fn"

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == rank and first[0]:
            first[0] = False
            time.sleep(seconds)
        return inner(out, target)

    return Task(model=task.model, optimizer=task.optimizer, loss_fn=loss_fn)


def paced_task(model: str, opt: str, per_sample_s: float) -> Task:
    """make_task(model, opt) whose forward pass sleeps `per_sample_s` for every sample, in the start-up probe
    too: compute that scales with the share and that load does not move (the emulated slowdown sleeps a
    multiple of the measured compute, which on a busy machine includes time waiting for a core)."""
    import time

    task = make_task(model, opt)
    task.model.register_forward_pre_hook(lambda _, args: time.sleep(per_sample_s * len(args[0])))
    return task


def paused_in_training(make: Callable[[], Task], marker: str) -> Task:
    """make()'s task, whose worker 0 in its first training loss (the group formed, every worker in it) creates
    `marker` and waits until `marker`.go exists: a test looks at the running workers meanwhile."""

    import torch.distributed as dist

    task = make()
    inner, first = task.loss_fn, [True]
    assert inner is not None, "a task with a loss_fn"

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 0 and first[0]:
            first[0] = False
            open(marker, "w").close()
            _wait_for(marker + ".go")
        return inner(out, target)

    return Task(model=task.model, optimizer=task.optimizer, loss_fn=loss_fn)


def one_worker_builds_another_model(marker: str) -> Task:
    """The first process to build takes a wider first layer (a node with other code): the preflight must
    name the parameter and both shapes."""
    import os

    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        width = 48
    except FileExistsError:
        width = 32
    model = nn.Sequential(nn.Linear(20, width), nn.Tanh(), nn.Linear(width, 5))
    return Task(model=model, optimizer=optimizer("sgd", model.parameters()), loss_fn=nn.functional.cross_entropy)


def dropout_task_with_schedule() -> Task:
    """An MLP with dropout and a StepLR schedule: resuming exactly needs every worker's random streams and
    the scheduler's position back."""
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Task(
        model=model,
        optimizer=opt,
        loss_fn=nn.functional.cross_entropy,
        scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7),
    )


def medium_task() -> Task:
    """An MLP of 66k parameters (260 KB) with SGD momentum: a checkpoint is about half a megabyte."""
    model = nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 236), nn.Tanh(), nn.Linear(236, 5))
    return Task(model=model, optimizer=optimizer("sgd", model.parameters()), loss_fn=nn.functional.cross_entropy)


def wide_mlp_task(cores: tuple[int, ...] | None = None) -> Task:
    """The speed benchmark's MLP shape (784-512-512-10, SGD with momentum), with tanh: enough compute per sample
    that a core's share shows. Not ReLU: a pre-activation next to 0 flips with the rounding of a split batch,
    and that discrete change grows to 1e-4 relative in 120 steps in one process alone (a batch of 128 split
    62/66 for 30 steps, then whole); with tanh the worst of 65 such splits stays under 3e-7.

    `cores`: the worker's thread runs on these CPUs only (os.sched_setaffinity), so a test can put a busy
    program beside it whatever the machine's size."""
    import os

    if cores is not None:
        os.sched_setaffinity(0, set(cores))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10))
    return Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        loss_fn=nn.functional.cross_entropy,
    )


class _EvalMemory(nn.Module):
    """`inner`, whose held-out forward passes (eval mode, rank in `limits`) raise torch's OutOfMemoryError past
    `limits[rank]` samples, as a card with no room for a big held-out batch does (0: not even one sample)."""

    def __init__(self, inner: nn.Module, limits: dict[int, int]) -> None:
        super().__init__()
        self.inner = inner
        self.limits = limits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else -1
        if not self.training and rank in self.limits and len(x) > self.limits[rank]:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(x)} samples (test)")
        return self.inner(x)


def eval_memory_task(model: str, opt: str, limits: dict[int, int]) -> Task:
    inner = MODELS[model]()
    m = _EvalMemory(inner, limits)
    return Task(model=m, optimizer=optimizer(opt, m.parameters()), loss_fn=nn.functional.cross_entropy)
