"""Held-out evaluation of one batch as sums that add up over batches and workers: the mean loss times the
batch's samples, argmax accuracy for class targets (with loss_fn), and the user's metrics' (sum, count); a worker's
passes over its slice of the held-out samples (HeldOut: halving its batch on out-of-memory, or in lock-step with
the other ranks); and the driver's side: slices left by a worker out of memory, the workers' sums summed up."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mixtrain.data.sources import EVAL_EPOCH, SampleSource, to_device
from mixtrain.devices import precision
from mixtrain.errors import InputTypeError
from mixtrain.observe import worker_log
from mixtrain.policies.planner import equal_shares
from mixtrain.task import Task

METRIC = "metric:"
"""Prefix of the sums a user metric adds: metric:NAME:sum and metric:NAME:count."""


def batch_sums(task: Task, batch: Any, num_samples: int) -> Iterator[tuple[str, float]]:
    if task.compute_loss is None:
        assert task.loss_fn is not None
        *inputs, target = batch
        out = task.model(*inputs)
        if isinstance(out, torch.Tensor):
            out = out.float()
        yield "loss_sum", float(task.loss_fn(out, target)) * num_samples
        if isinstance(out, torch.Tensor) and not target.is_floating_point() and out.shape[:-1] == target.shape:
            yield "correct", float((out.argmax(-1) == target).sum())
            yield "targets", float(target.numel())
    else:
        yield "loss_sum", float(task.batch_loss(task.model, batch).detach()) * num_samples
    yield "samples", float(num_samples)
    if task.metrics is not None:
        for name, pair in task.metrics(task.model, batch).items():
            total, count = _pair(name, pair)
            yield f"{METRIC}{name}:sum", total
            yield f"{METRIC}{name}:count", count


def _pair(name: str, pair: Any) -> tuple[float, float]:
    try:
        total, count = pair
        return float(total), float(count)
    except (TypeError, ValueError):
        raise InputTypeError(
            f"Task.metrics returned {name!r}: {pair!r}; each metric must be a (sum, count) pair, e.g. "
            "{'accuracy': ((pred == y).sum().item(), len(y))}"
        ) from None


@dataclass
class HeldOut:
    """One worker's passes over its slice of the held-out samples, as sums that add up (batch_sums)."""

    task: Task
    source: SampleSource
    device: torch.device
    precision: str

    def halving(
        self, start: int, stop: int, batch: int, is_oom: Callable[[BaseException], bool], after_oom: Callable[[], None]
    ) -> tuple[dict[str, float], int | None]:
        """Sums over [start, stop) in batches of at most `batch`, and the batch it was halved to (None: never).
        Out of memory, the batch is halved and the rest read again; when even one sample does not fit, the sums so
        far come back with LEFT, the first sample left."""
        sums: dict[str, float] = defaultdict(float)
        halved = None
        done = [start]  # the first sample not evaluated yet
        while done[0] < stop:
            try:
                self._evaluate_from(done, stop, batch, sums)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                after_oom()
                if batch == 1:
                    worker_log.log.warning("evaluation: out of memory at one sample from sample %d", done[0])
                    sums[LEFT] = float(done[0])
                    break
                batch = halved = batch // 2
                worker_log.log.warning("evaluation: out of memory; batch halved to %d", batch)
        return dict(sums), halved

    def lockstep(self, start: int, stop: int, batch: int, idle_pass: Callable[[], None]) -> dict[str, float]:
        """Sliced state: every forward pass calls collectives, so every rank runs as many (the most any rank
        needs; idle ones are `idle_pass`). No halving on out-of-memory here: the ranks would fall out of step."""
        sums: dict[str, float] = defaultdict(float)
        mine = -(-(stop - start) // batch)
        most = torch.tensor([mine], dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        self._evaluate_from([start], stop, batch, sums)
        for _ in range(int(most) - mine):
            idle_pass()
        return dict(sums)

    def _evaluate_from(self, done: list[int], stop: int, batch: int, sums: dict[str, float]) -> None:
        """Evaluate [done[0], stop) in batches of `batch`: each finished batch is added to `sums` and moves done[0]."""
        chunks = [np.arange(i, min(i + batch, stop)) for i in range(done[0], stop, batch)]
        for chunk, samples in zip(chunks, self.source.batches(EVAL_EPOCH, chunks)):
            with precision.autocast(self.device, self.precision):
                part = list(batch_sums(self.task, to_device(samples, self.device), len(chunk)))
            for name, value in part:  # only a batch that finished counts
                sums[name] += value
            done[0] = int(chunk[-1]) + 1


LEFT = "unevaluated_from"
"""A worker's sums carry this when even one sample ran out of memory: the first sample of its slice left."""


def leftovers(parts: list[dict[str, float]], bounds: list[tuple[int, int]]) -> tuple[list[list[tuple[int, int]]], str]:
    """What the workers that ran out of memory left of their slices, split among those that did not: one list of
    per-rank slices per leftover range (empty slices for the rest), and the line that says so ("" when none)."""
    failed = [r for r, part in enumerate(parts) if LEFT in part]
    if not failed:
        return [], ""
    able = [r for r in range(len(parts)) if r not in failed]
    ranges = [(int(parts[r][LEFT]), bounds[r][1]) for r in failed]
    left = sum(b - a for a, b in ranges)
    who = ", ".join(f"worker {r}" for r in failed)
    if not able:
        return [], f"held-out: out of memory at one sample on {who}: {left} samples not evaluated"
    passes = []
    for lo, hi in ranges:
        sizes = equal_shares(hi - lo, len(able))
        slices = [(lo, lo)] * len(parts)
        for i, r in enumerate(able):
            start = lo + sum(sizes[:i])
            slices[r] = (start, start + sizes[i])
        passes.append(slices)
    return passes, f"held-out: out of memory at one sample on {who}: its {left} samples went to the others"


def summarize(parts: list[dict[str, float]]) -> dict[str, float]:
    """The workers' sums as held-out figures: loss, samples, accuracy where counted, each user metric."""
    total: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            if k == LEFT:
                continue
            total[k] = total.get(k, 0.0) + v
    if not total.get("samples"):  # no worker could evaluate a sample (the note said why)
        return {"loss": float("nan"), "samples": 0.0}
    out = {"loss": total["loss_sum"] / total["samples"], "samples": total["samples"]}
    if total.get("targets"):
        out["accuracy"] = total["correct"] / total["targets"]
    for key, value in total.items():
        if key.startswith(METRIC) and key.endswith(":sum"):
            name = key[len(METRIC) : -len(":sum")]
            count = total[f"{METRIC}{name}:count"]
            out[name] = value / count if count else float("nan")
    return out
