"""MIXTRAIN_PROFILE_DIR: a worker profiles three rounds after three of warm-up, and nothing when unset."""

from __future__ import annotations

import torch

from mixtrain.observe.round_profile import PROFILE_DIR, PROFILED_ROUNDS, SKIP_ROUNDS, RoundProfiler


def _rounds(profiler: RoundProfiler, n: int) -> None:
    for _ in range(n):
        with profiler.round(torch.device("cpu")):
            torch.randn(64, 64) @ torch.randn(64, 64)


def test_three_rounds_after_the_warm_up_are_profiled_into_the_workers_file(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR, str(tmp_path / "prof"))
    _rounds(RoundProfiler(rank=2), SKIP_ROUNDS + PROFILED_ROUNDS + 2)
    text = (tmp_path / "prof" / "worker-2.txt").read_text()
    headers = [line for line in text.splitlines() if line.startswith("# round")]
    assert [h.split()[2] for h in headers] == [str(SKIP_ROUNDS + i) for i in range(PROFILED_ROUNDS)]
    assert "aten::mm" in text and "ms wall" in headers[0]


def test_unset_it_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    profiler = RoundProfiler(rank=0)
    _rounds(profiler, SKIP_ROUNDS + 1)
    assert profiler.file is None and list(tmp_path.iterdir()) == []
