"""Data for training: the step-indexed sampler."""
