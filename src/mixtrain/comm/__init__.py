"""Collectives among workers: process group, gradient buckets, sync strategies."""
