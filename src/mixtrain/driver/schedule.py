"""When a run ends and evaluates, in global steps, and how the held-out set splits among the workers. No Ray;
the run's checkpoints are driver/checkpointing.py's."""

from __future__ import annotations

from dataclasses import dataclass

from mixtrain.policies.planner import equal_shares, largest_remainder


@dataclass
class Steps:
    """Where a run ends and when it evaluates, in global steps (epoch x steps per epoch + step): the last epoch's
    end or RunConfig.max_steps, whichever comes first; an evaluation every RunConfig.eval_every steps, or at each
    epoch's end, when there is held-out data. Rounds are cut so each of these falls on a round boundary."""

    per_epoch: int
    epochs: int = 0
    max_steps: int | None = None
    eval_every: int | None = None
    evaluates: bool = False

    def at(self, epoch: int, step: int) -> int:
        return epoch * self.per_epoch + step

    @property
    def last(self) -> int:
        end = self.epochs * self.per_epoch
        return end if self.max_steps is None else min(end, self.max_steps)

    def round_length(self, epoch: int, step: int, wanted: int) -> int:
        """`wanted` steps from (epoch, step), or fewer: up to the epoch's end, the last step, the next evaluation."""
        now = self.at(epoch, step)
        limit = min(wanted, self.per_epoch - step, self.last - now)
        if self.eval_every and self.evaluates:
            limit = min(limit, self.eval_every - now % self.eval_every)
        return limit

    def eval_due(self, epoch: int, step: int) -> bool:
        """An evaluation after `step` steps of `epoch` (the run's own end aside: it always evaluates)."""
        if not self.evaluates:
            return False
        if self.eval_every:
            return self.at(epoch, step) % self.eval_every == 0
        return step >= self.per_epoch


EVAL_BATCH = 1024
"""The largest held-out batch a worker evaluates at once; a worker whose training micro-batch is capped by its
memory evaluates at most that many (a forward pass without gradients needs less than the step it was sized
for), and halves again if even that runs out of memory."""


def eval_split(
    num_eval: int, num_workers: int, speeds: list[float] | None, collective_s: float, round_s: float
) -> tuple[list[tuple[int, int]], float]:
    """Each worker's contiguous slice [start, stop) of the held-out set, sized by its measured speed (equal until
    every worker was measured; zeros when fewer samples than workers), and the deadline: the collective timeout
    plus twice the slowest worker's measured time for its slice (a forward pass is cheaper than the training step
    it was timed on), so a worker asleep is found out in about the collective timeout, not in half an hour."""
    measured = speeds is not None and len(speeds) == num_workers and all(v > 0 for v in speeds)
    sizes = largest_remainder(speeds, num_eval) if measured and speeds else equal_shares(num_eval, num_workers)
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    if not speeds:
        return bounds, round_s
    slowest = max((n / v for n, v in zip(sizes, speeds) if v > 0), default=0.0)
    return bounds, collective_s + 2 * slowest


def eval_batches(memory_caps: list[int | None], largest: int = EVAL_BATCH) -> list[int]:
    """Per worker, the held-out batch it starts from: EVAL_BATCH, or its training micro-batch cap when it has one."""
    return [min(largest, cap) if cap else largest for cap in memory_caps]
