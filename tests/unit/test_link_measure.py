"""The start-up link measurement in bounded time (comm.link_measure), on a clock that moves only when the
"link" does: an exchange of N bytes costs a fixed latency plus N at the link's pace. No process group: one
rank, whose times are every rank's."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mixtrain.comm import link_measure
from mixtrain.comm.link_measure import MEASURE_BUDGET_S, PROBE_BYTES, exchange_seconds


class Link:
    """A fake clock and a link on it: each call moves the clock by latency + bytes / pace."""

    def __init__(self, mb_per_s: float, latency_s: float = 0.005) -> None:
        self.now, self.pace, self.latency = 0.0, mb_per_s * 1e6, latency_s
        self.real_calls = 0
        self.probed: list[int] = []

    def perf_counter(self) -> float:
        return self.now

    def cost(self, nbytes: int) -> float:
        return self.latency + nbytes / self.pace

    def exchange(self, nbytes: int) -> Callable[[], None]:
        def call() -> None:
            self.real_calls += 1
            self.now += self.cost(nbytes)

        return call

    def probe(self, nbytes: int) -> Callable[[], None]:
        def call() -> None:
            self.probed.append(nbytes)
            self.now += self.cost(nbytes)

        return call


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Link]:
    def make(mb_per_s: float, latency_s: float = 0.005) -> Link:
        fake = Link(mb_per_s, latency_s)
        monkeypatch.setattr(link_measure.time, "perf_counter", fake.perf_counter)
        return fake

    return make


def test_a_quick_exchange_is_timed_itself(link: Callable[..., Link]) -> None:
    lan = link(mb_per_s=100)  # 25 MB: 0.25 s an exchange
    nbytes = 25_000_000
    seconds = exchange_seconds(lan.exchange(nbytes), lan.probe, nbytes, repeats=5)
    assert seconds == pytest.approx(lan.cost(nbytes))
    assert lan.real_calls == 6  # a warm-up and five repeats (1.5 s: inside the budget)
    assert lan.probed == [PROBE_BYTES]  # the one probe that said so


@pytest.mark.parametrize("mb_per_s,nbytes", [(0.625, 96_600_000), (6.25, 500_000_000), (125, 2_000_000_000)])
def test_a_slow_exchange_is_extrapolated_in_a_few_seconds(
    link: Callable[..., Link], mb_per_s: float, nbytes: int
) -> None:
    """chars-large's fp32 delta over 5 Mbit/s (155 s an exchange), GPT-2's over 50 Mbit/s (80 s: past the
    collective timeout), a 2 GB model on a 1 Gbit/s LAN (16 s)."""
    wifi = link(mb_per_s)
    seconds = exchange_seconds(wifi.exchange(nbytes), wifi.probe, nbytes, repeats=5)
    assert seconds == pytest.approx(wifi.cost(nbytes), rel=1e-6)  # the line through two probes, exactly
    assert wifi.real_calls == 0
    assert wifi.now <= 3 * MEASURE_BUDGET_S  # what measuring took
    assert len(set(wifi.probed)) == 2 and max(wifi.probed) < nbytes


def test_a_large_probe_that_reaches_the_exchange_is_its_time(link: Callable[..., Link]) -> None:
    slow = link(mb_per_s=0.5)  # 2 MB: 4 s at this pace, over the budget, and the second probe would be larger
    nbytes = 2_000_000
    seconds = exchange_seconds(slow.exchange(nbytes), slow.probe, nbytes, repeats=5)
    assert seconds == pytest.approx(slow.cost(nbytes))
    assert slow.real_calls == 0 and max(slow.probed) == nbytes


def test_noise_that_makes_the_line_fall_takes_the_larger_probes_pace(
    link: Callable[..., Link], monkeypatch: pytest.MonkeyPatch
) -> None:
    noisy = link(mb_per_s=1.0)
    first = noisy.probe

    def probe(nbytes: int) -> Callable[[], None]:  # the small probe slowed down by something else on the link
        call = first(nbytes)
        if nbytes > PROBE_BYTES:
            return call

        def slowed() -> None:
            call()
            noisy.now += 5.0

        return slowed

    nbytes = 50_000_000
    seconds = exchange_seconds(noisy.exchange(nbytes), probe, nbytes, repeats=5)
    big = max(noisy.probed)
    assert seconds == pytest.approx(noisy.cost(big) * nbytes / big)
    assert noisy.real_calls == 0
