"""A step skipped on the GPU when its gradient is not finite, without the host waiting for the verdict.

mixtrain skips a step whose summed gradient (or loss) holds a NaN or an Inf. Deciding that on the host means
reading a value from the GPU before the optimizer's kernels can be queued: one wait per step, which left the
GPU idle while the host queued the next kernels. On an H200 that wait took a plain PyTorch loop on the chars
model from 13,417 to 12,054 samples/s in one run and cost about 1% in another (the GPU check's overhead step,
2026-11-26); it was not what held one CUDA worker at 0.72-0.88x a plain loop (docs/gpu-check.md).

torch's fused Adam, AdamW and SGD take the verdict as a tensor (`found_inf`, as GradScaler hands it to them)
and skip the update on the device, the step count included. So, for a worker alone in its group (no exchange
that waits anyway) on a CUDA device, with no fp16 loss scaling and the whole optimizer state on the worker:
the verdict is computed on the device (the elementwise check GradScaler uses, with a scale of 1), the
optimizer runs its fused kernel with it, and the verdict is copied to the host behind an event, read one step
later (by then long done, so the read does not wait). What depends on it moves with it: the learning-rate
scheduler steps after an applied step is known (before the next step's update, so the next update sees the
right rate), and the ledger hears of the step then.

The user's optimizer is switched to its fused implementation (the same algorithm; the last bits of a result can
differ from the for-each one, as between any two of torch's implementations) and stays so for the fit (a group
that grows keeps it); checkpoints record the user's own setting. Any other optimizer, or an explicit
`foreach=True`, keeps the host's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixtrain import devices

FUSED_SKIPPING = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""The optimizers whose fused kernels skip an update when `found_inf` is set (exact types: a subclass may
override step)."""


def can_gate(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """True when `optimizer` can skip a step on `device` itself."""
    if type(optimizer) not in FUSED_SKIPPING:
        return False
    for group in optimizer.param_groups:
        if group.get("foreach") or group.get("differentiable") or group.get("capturable"):
            return False
        for p in group["params"]:
            if p.device != device or not p.is_floating_point():
                return False
    return True


@dataclass
class _Pending:
    on_host: torch.Tensor  # its pinned copy, valid once `ready` has passed
    ready: Any  # a torch.cuda.Event (None off CUDA: the copy is done when made)
    stats: torch.Tensor
    norm: torch.Tensor | None


Verdict = tuple[bool, torch.Tensor, "torch.Tensor | None"]
"""A settled step: (applied, its statistics, its gradient norm when applied and clipped)."""


class StepGate:
    """Runs `optimizer.step()` so that a non-finite step is skipped on the device; the step's verdict is read
    when the next step is queued (or by `settle()`), and `drain()` hands the settled verdicts over."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.device = device
        self.found_inf = torch.zeros((), device=device)  # 0-dim, as GradScaler's (the step counts are)
        self.one = torch.ones((), device=device)
        self.pending: _Pending | None = None
        self.settled: list[Verdict] = []

    def step(self, task: Any, grads: list[torch.Tensor], stats: torch.Tensor, clip: Any) -> None:
        """Queue this step's update, skipped on the device when `grads` or `stats` hold a NaN or an Inf
        (`clip()` clips the gradient first and returns its norm); the step before is settled first."""
        self.settle(task)
        optimizer = task.optimizer
        _use_fused(optimizer)
        found_inf = self.found_inf.zero_()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.one)  # x * 1: unchanged
        bad_loss = torch.logical_not(torch.isfinite(stats.detach().float())).any().float()
        found_inf = torch.maximum(found_inf, bad_loss)
        norm = clip()
        optimizer.found_inf = found_inf  # as GradScaler hands it over
        optimizer.grad_scale = None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        on_host = torch.empty((), pin_memory=self.device.type == "cuda")
        on_host.copy_(found_inf, non_blocking=devices.get(self.device.type).non_blocking_copies)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.pending = _Pending(on_host, ready, stats, norm)

    def settle(self, task: Any) -> None:
        """Read the outstanding step's verdict (waiting for that step's check alone, not for what was queued
        after it); the scheduler steps after an applied step, as it would have right after it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        applied = float(pending.on_host) == 0.0
        if applied and task.scheduler is not None:
            task.scheduler.step()
        self.settled.append((applied, pending.stats, pending.norm if applied else None))

    def drain(self) -> list[Verdict]:
        """The verdicts settled since the last drain, oldest first."""
        out, self.settled = self.settled, []
        return out


USER_FUSED = "_mixtrain_user_fused"
"""The optimizer attribute that keeps each group's `fused` as the user built it, once the gate switched it."""


def as_user_built(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`optimizer`'s state_dict `state` with each group's `fused` (and `foreach`) as the user had them, so a
    checkpoint loads the same way wherever it is resumed."""
    settings = getattr(optimizer, USER_FUSED, None)
    if settings is not None:
        for group, (fused, foreach) in zip(state.get("param_groups", []), settings):
            group["fused"], group["foreach"] = fused, foreach
    return state


def _use_fused(optimizer: torch.optim.Optimizer) -> None:
    """Switch `optimizer` to its fused kernel (again, after a load_state_dict that brought other settings):
    each group's `fused`, and the step counts where the fused kernel keeps them (float32 on the device)."""
    if all(group.get("fused") for group in optimizer.param_groups):
        return
    if not hasattr(optimizer, USER_FUSED):
        setattr(optimizer, USER_FUSED, [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups])
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
