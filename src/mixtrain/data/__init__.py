"""Data for training: datasets and loader options a user passes in, and the rule that seeds augmentation.

Public: `Loader` (a Dataset with its DataLoader options), `TokenWindows` (next-token windows over a
token file, read one window at a time) and `seed_sample` (the per-sample seeding rule, for a single-process reference).
"""

from mixtrain.data.sources import Loader, seed_sample
from mixtrain.data.tokens import TokenWindows

__all__ = ["Loader", "TokenWindows", "seed_sample"]
