"""Gradients flattened into buckets and summed across ranks through CPU buffers.

Each parameter's `.grad` is a view into its bucket (as DDP's gradient_as_bucket_view), so
backward writes straight into the buffer that is all-reduced: on a CPU device there is no
copy at all, on an accelerator one copy each way through a CPU staging buffer (gloo has no
MPS tensors, and mixed groups cannot use NCCL).

Buckets follow the parameters in reverse order, the order backward produces gradients, and
a bucket's all-reduce starts from a post-accumulate-grad hook as soon as its last gradient
is written, so communication overlaps the rest of backward. The first bucket is small so
that overlap starts early (DDP does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

FIRST_BUCKET_BYTES = 1 << 20


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor  # on the parameters' device; grads are views into it
    host: torch.Tensor  # buffer on the comm device (CPU for gloo, the GPU for NCCL): flat + spare slots
    staged: bool  # True when flat is not on the comm device and is copied through host
    pending: int = 0
    work: Any = None
    views: list[torch.Tensor] = field(default_factory=list)

    def bind_grads(self) -> None:
        """Point every .grad at its view; keeps the value of a .grad that user code replaced."""
        if not self.views:
            offset = 0
            for p in self.params:
                self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        for p, view in zip(self.params, self.views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def launch(self) -> None:
        self.bind_grads()
        if self.staged:
            self.host[: self.flat.numel()].copy_(self.flat)
        self.work = dist.all_reduce(self.host, op=dist.ReduceOp.SUM, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        self.work = None
        if self.staged:
            self.flat.copy_(self.host[: self.flat.numel()])


class GradBuckets:
    """The gradients of `params`, grouped into buckets of about `bucket_bytes`.

    `num_extras` spare slots ride at the end of the last bucket: small per-step statistics
    (the loss) are summed in the same collective instead of a separate one, which costs as
    much as a whole bucket on a small model.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        bucket_bytes: int,
        num_extras: int = 0,
        comm_device: torch.device | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.comm_device = comm_device or torch.device("cpu")  # gloo: CPU; NCCL: the GPU itself
        self.wire_dtype = wire_dtype  # compression: the collective sums in this dtype (bf16/fp16)
        self.solo = not dist.is_initialized() or dist.get_world_size() == 1
        """One rank (the others left out): the sum is the gradient itself, no collective or staging copy runs."""
        self.buckets: list[_Bucket] = []
        self._armed = False
        self._next = 0  # buckets start strictly in order, so every rank issues the same collectives
        self._hooks: list[Any] = []
        groups: list[list[torch.nn.Parameter]] = [[]]
        size, limit = 0, min(bucket_bytes, FIRST_BUCKET_BYTES)
        for p in reversed(params):
            group = groups[-1]
            if group and (p.dtype != group[0].dtype or p.device != group[0].device or size >= limit):
                groups.append([])
                size, limit = 0, bucket_bytes
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        for i, group in enumerate(groups):
            if group:
                self._add(group, num_extras if i == len(groups) - 1 else 0)
        self.num_extras = num_extras

    def _add(self, params: list[torch.nn.Parameter], num_extras: int) -> None:
        numel = sum(p.numel() for p in params)
        device, dtype = params[0].device, params[0].dtype
        wire = self.wire_dtype or dtype
        host = torch.zeros(numel + num_extras, dtype=wire, device=self.comm_device)
        staged = device != self.comm_device or wire != dtype  # a narrower wire dtype always copies (and casts)
        flat = torch.zeros(numel, dtype=dtype, device=device) if staged else host[:numel]
        bucket = _Bucket(params, flat, host, staged)
        bucket.bind_grads()
        self.buckets.append(bucket)
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad(b)))

    def close(self) -> None:
        """Unhook from the parameters (before another GradBuckets takes them over)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, bucket: _Bucket) -> None:
        if not self._armed:
            return
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        # The last bucket waits for all_reduce_, which writes the extras into it first.
        while self._next < len(self.buckets) - 1 and self.buckets[self._next].pending == 0:
            self.buckets[self._next].launch()
            self._next += 1

    def arm(self) -> None:
        """Let the hooks of the next backward start all-reduces (call before a step's last backward)."""
        self._armed = not self.solo

    def zero_(self) -> None:
        """Zero the gradients; hooks stay quiet until arm()."""
        for b in self.buckets:
            b.bind_grads()
            b.host.zero_()
            if b.staged:
                b.flat.zero_()
            b.pending = len(b.params)
        self._next = 0
        self._armed = False

    def all_reduce_(self, extras: torch.Tensor | None = None) -> None:
        """Sum the gradients and `extras` (a small CPU tensor of num_extras values) over all ranks, in place.
        Buckets whose hooks did not fire (no samples on this rank, unused parameters) start here."""
        self._armed = False
        if self.solo:  # nothing to sum with: the gradients and `extras` are already the totals
            self._next = len(self.buckets)
            return
        last = self.buckets[-1]
        if self.num_extras:
            assert extras is not None and extras.numel() == self.num_extras, "extras must match num_extras"
            last.host[last.flat.numel() :].copy_(extras.to(last.host.device))
        for b in self.buckets[self._next :]:
            b.launch()
        self._next = len(self.buckets)
        for b in self.buckets:
            b.finish()
        if self.num_extras:
            extras.copy_(last.host[last.flat.numel() :].to("cpu"))  # type: ignore[union-attr]

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank puts into one step's all-reduce."""
        return 0 if self.solo else sum(b.host.numel() * b.host.element_size() for b in self.buckets)

    def scale_(self, factor: float) -> None:
        """Multiply every gradient by `factor` (undoing a loss scale)."""
        for b in self.buckets:
            b.flat.mul_(factor)

    def all_finite(self) -> bool:
        """True when every summed gradient is finite. After the sum a NaN or Inf on any rank
        is on every rank, so all ranks reach the same verdict without another collective.
        A NaN or Inf makes the bucket's sum non-finite; a sum is ~30x cheaper than an
        elementwise isfinite, which runs only when the sum is not finite, to tell a real
        NaN/Inf from a sum that merely overflowed."""
        summed = [b.flat if self.solo else b.host for b in self.buckets]  # solo: nothing was staged
        return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in summed)
