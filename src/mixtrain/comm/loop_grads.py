"""The gradient exchange of a model prepared for the user's own loop (mixtrain.train.torch.prepare_model).

Every backward outside `no_sync()` sums the gradients over the group, each rank's weighted by its share of the
step's global batch (`weight` = b_i / B): with each rank's loss the mean over its own batch, the sum is the
gradient of the mean over the whole global batch, so `.grad` after `backward()` is what one process training the
whole batch would have, whatever the split. Under `no_sync()` each backward's gradient is weighted the same way and
only accumulated; the next synchronised backward sums the lot.

As for a Task (comm/buckets.py), gradients are views into flat buckets and a bucket's all-reduce starts from a
post-accumulate-grad hook as soon as its last gradient is written; the weighting is one multiply of the bucket
just before. A callback queued on the autograd engine (as DDP does) waits for the sums before `backward()` returns.

Weighting an accumulation exactly: before a backward, gradients accumulated by earlier `no_sync()` backwards (each
already weighted) are divided by this backward's weight, so that multiplying the whole after it weights only its
own part: S/w + g, times w, is S + w g. Rounding costs about one ulp, far inside the tests' 1e-5.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mixtrain.comm.buckets import GradBuckets, _Bucket, bind_grad_views, grad_views


def _queue_callback(fn: Callable[[], None]) -> None:
    """Run `fn` once the current backward pass has finished (what DDP uses to wait for its all-reduces)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class LoopGrads(GradBuckets):
    """The prepared model's gradients: weighted, bucketed, summed over the group during backward."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int, comm_device: torch.device) -> None:
        super().__init__(params, bucket_bytes, num_extras=0, comm_device=comm_device)
        self.weight = 1.0
        self.comm_s = 0.0
        """Seconds spent waiting for the sums (a faster rank waits for the slower ones here too)."""
        self.on_work: Callable[[float], None] | None = None
        """Told each forward-and-backward's seconds as its backward ends, before the last sums start (EMULATION
        of a slower device sleeps there: worker/emulation.py)."""
        self._t_forward: float | None = None
        self._active = False  # a prepared forward ran: this backward is ours to weight (and maybe sum)
        self._queued = False
        self._accumulating = False  # the gradients hold weighted no_sync backwards, not summed yet
        self._kept: list[torch.Tensor] | None = None

    def before_forward(self, weight: float, sync: bool) -> None:
        """The prepared model's forward, with gradients enabled: get the buckets ready for its backward. A weight
        of 0 (an empty batch at an epoch's end) keeps what was there: this backward counts for nothing."""
        self._kept = None
        if self._t_forward is None:
            self._t_forward = time.perf_counter()
        for bucket in self.buckets:
            _bind_fresh(bucket)
            bucket.pending = len(bucket.params)
        if self._accumulating and weight == 0.0:
            self._kept = [bucket.flat.clone() for bucket in self.buckets]
        elif self._accumulating and weight != 1.0:
            for bucket in self.buckets:
                bucket.flat.div_(weight)
        self.weight = weight
        self._armed, self._active, self._next, self._queued = sync, True, 0, False

    def _on_grad(self, bucket: _Bucket) -> None:
        if not self._active:
            return
        if not self._queued:
            self._queued = True
            _queue_callback(self._after_backward)
        if not self._armed:
            return
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.bind_grads()
        self._weigh(bucket)
        bucket.launch()

    def _weigh(self, bucket: _Bucket) -> None:
        """This backward's gradient times its weight (see before_forward)."""
        if self.weight == 0.0:  # no samples: whatever backward made (NaN from a mean over none) counts for nothing
            if self._kept is not None:
                bucket.flat.copy_(self._kept[self.buckets.index(bucket)])
            else:
                bucket.flat.zero_()
        elif self.weight != 1.0:
            bucket.flat.mul_(self.weight)

    def _after_backward(self) -> None:
        if self._t_forward is not None and self.on_work is not None:
            self.on_work(time.perf_counter() - self._t_forward)
        self._t_forward = None
        t0 = time.perf_counter()
        if self._armed:
            for bucket in self.buckets[self._next :]:  # parameters this backward did not reach
                self._launch(bucket)
            self._next = len(self.buckets)
            for bucket in self.buckets:
                bucket.finish()
            self._accumulating = False
        else:
            for bucket in self.buckets:
                bucket.bind_grads()
                self._weigh(bucket)
            self._accumulating = True
        self._armed = self._active = self._queued = False
        self.comm_s += time.perf_counter() - t0


def _bind_fresh(bucket: _Bucket) -> None:
    """Gradients set to None (zero_grad's default) start again from zero, in the bucket: .grad is a view of it."""
    if not bucket.views:
        bucket.views = grad_views(bucket.params, bucket.flat)
    missing = [view for p, view in zip(bucket.params, bucket.views) if p.grad is None]
    if len(missing) == len(bucket.params):
        bucket.flat.zero_()
    else:
        for view in missing:
            view.zero_()
    bind_grad_views(bucket.params, bucket.views)
