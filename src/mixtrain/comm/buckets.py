"""Gradients flattened into buckets and summed across ranks through CPU buffers.

Each parameter's `.grad` is a view into its bucket (as DDP's gradient_as_bucket_view), so
backward writes straight into the buffer that is all-reduced: on a CPU device there is no
copy at all, on an accelerator one copy each way through a CPU staging buffer (gloo has no
MPS tensors, and mixed groups cannot use NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor  # on the parameters' device; grads are views into it
    host: torch.Tensor  # CPU buffer that goes through gloo; `flat` itself when the device is CPU

    def bind_grads(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            view = self.flat[offset : offset + n].view_as(p)
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # the user's code replaced .grad: keep its value
            p.grad = view
            offset += n


class GradBuckets:
    """The gradients of `params`, grouped into buckets of about `bucket_bytes`."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int) -> None:
        self.buckets: list[_Bucket] = []
        group: list[torch.nn.Parameter] = []
        size = 0
        for p in params:
            if group and (p.dtype != group[0].dtype or p.device != group[0].device or size >= bucket_bytes):
                self.buckets.append(self._make(group))
                group, size = [], 0
            group.append(p)
            size += p.numel() * p.element_size()
        if group:
            self.buckets.append(self._make(group))

    @staticmethod
    def _make(params: list[torch.nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        host = flat if flat.device.type == "cpu" else torch.zeros(numel, dtype=flat.dtype)
        bucket = _Bucket(params, flat, host)
        bucket.bind_grads()
        return bucket

    def zero_(self) -> None:
        for b in self.buckets:
            b.bind_grads()  # cheap pointer check; re-binds if user code set .grad to None or a new tensor
            b.flat.zero_()

    def all_reduce_(self, extras: torch.Tensor | None = None) -> None:
        """Sum the gradients (and the small CPU tensor `extras`) over all ranks, in place."""
        works = []
        for b in self.buckets:
            b.bind_grads()
            if b.host is not b.flat:
                b.host.copy_(b.flat)
            works.append((b, dist.all_reduce(b.host, op=dist.ReduceOp.SUM, async_op=True)))
        extras_work = dist.all_reduce(extras, op=dist.ReduceOp.SUM, async_op=True) if extras is not None else None
        for b, work in works:
            work.wait()
            if b.host is not b.flat:
                b.flat.copy_(b.host)
        if extras_work is not None:
            extras_work.wait()

    def all_finite(self) -> bool:
        """True when every summed gradient is finite. After the sum a NaN or Inf on any rank
        is on every rank, so all ranks reach the same verdict without another collective."""
        return all(bool(torch.isfinite(b.host).all()) for b in self.buckets)
