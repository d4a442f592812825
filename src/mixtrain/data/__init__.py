"""Data for training: datasets and loader options a user passes in, and the rule that seeds augmentation.

Public: `Loader` (a Dataset with its DataLoader options), `TokenWindows` (next-token windows over a
token file, read one window at a time), `seed_sample` (the per-sample seeding rule, for a single-process reference)
and `steps_per_epoch` (optimizer steps in an epoch: a schedule's total is epochs times it).
"""

from mixtrain.data.sampling import steps_per_epoch
from mixtrain.data.sources import Loader, seed_sample
from mixtrain.data.tokens import TokenWindows

__all__ = ["Loader", "TokenWindows", "seed_sample", "steps_per_epoch"]
