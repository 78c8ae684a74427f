"""The throughput estimator against values worked out by hand (harmonic means of a few samples)."""

from __future__ import annotations

import pytest

from cachegen.errors import ConfigError
from cachegen.stream.estimator import ThroughputEstimator


def hm(*xs: float) -> float:
    return len(xs) / sum(1.0 / x for x in xs)


def fed(*gbps: float, window: int = 5) -> ThroughputEstimator:
    e = ThroughputEstimator(window=window, min_bytes=0)
    for g in gbps:
        e.add_gbps(g)
    return e


def test_a_sample_is_bits_over_seconds_and_small_ones_do_not_count():
    e = ThroughputEstimator(min_bytes=1000)
    assert e.add(999, 1.0) is None and e.samples == []  # under min_bytes
    assert e.add(2000, 0.0) is None and e.add(2000, -1.0) is None and e.samples == []  # no duration
    assert e.add(1000, 1e-6) == pytest.approx(8.0, rel=1e-12)  # exactly min_bytes counts: 8000 bits in 1 us
    assert e.add(125_000_000, 0.5) == pytest.approx(2.0, rel=1e-12)
    assert e.samples == pytest.approx([8.0, 2.0], rel=1e-12)


def test_prior_last_and_known():
    cold = ThroughputEstimator()
    assert not cold.known and not cold.has_prior
    assert cold.last() == cold.estimate() == cold.harmonic_mean() == cold.tail_estimate() == 1.0  # the default
    warm = ThroughputEstimator(prior_gbps=3.0)
    assert warm.known and warm.last() == warm.estimate() == warm.tail_estimate() == 3.0
    cold.add_gbps(0.5)
    assert cold.known and cold.last() == 0.5
    cold.reset()
    assert not cold.known and cold.samples == [] and cold.s_per_bit_history() == []
    warm.add_gbps(7.0)
    warm.reset()
    assert warm.known and warm.estimate() == 3.0  # the prior survives a reset


@pytest.mark.parametrize("bad", [{"window": 0}, {"prior_gbps": 0.0}, {"prior_gbps": -1.0}])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ConfigError, match=r"^window must be >= 1 and prior_gbps > 0$"):
        ThroughputEstimator(**bad)


def test_the_smallest_parameters_work():
    e = ThroughputEstimator(window=1, prior_gbps=0.5)
    assert e.window == 1 and e.estimate() == 0.5
    e.add_gbps(2.0)
    e.add_gbps(3.0)
    assert e.samples == [3.0] and e.harmonic_mean() == 3.0


def test_the_default_window_is_five_samples_and_add_keeps_history():
    e = ThroughputEstimator(min_bytes=0)
    for seconds in (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125):  # 1 Gbit each: 1, 2, 4, 8, 16, 32 Gbit/s
        e.add(125_000_000, seconds)
    assert e.samples == pytest.approx([2.0, 4.0, 8.0, 16.0, 32.0], rel=1e-12)
    assert e.s_per_bit_history() == pytest.approx([1e-9 / g for g in (1, 2, 4, 8, 16, 32)], rel=1e-12, abs=0)


def test_the_window_keeps_the_last_samples_and_the_history_more():
    e = fed(1.0, 2.0, 4.0, 8.0, window=3)
    assert e.samples == [2.0, 4.0, 8.0]
    assert e.harmonic_mean() == pytest.approx(hm(2.0, 4.0, 8.0), rel=1e-12)  # 3.4286, the first sample gone
    assert e.s_per_bit_history() == pytest.approx([1e-9, 0.5e-9, 0.25e-9, 0.125e-9], rel=1e-12, abs=0)
    long = fed(*([1.0] * 70 + [2.0]))
    h = long.s_per_bit_history()
    assert (
        len(h) == 64
        and h[-1] == pytest.approx(0.5e-9, rel=1e-12, abs=0)
        and h[0] == pytest.approx(1e-9, rel=1e-12, abs=0)
    )


def test_estimate_is_the_latest_sample_when_it_is_below_the_mean():
    assert fed(4.0, 4.0, 1.0).estimate() == pytest.approx(1.0)  # a drop shows at once
    up = fed(1.0, 1.0, 8.0)
    assert up.estimate() == pytest.approx(hm(1.0, 1.0, 8.0)) == pytest.approx(1.4118, rel=1e-4)  # a rise slowly
    assert up.next_estimate(first_of_load=False) == up.estimate()


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        ((4.0, 1.0), hm(4.0, 1.0)),  # two samples: no older one to compare with, the mean (1.6)
        ((8.0, 8.0, 1.0, 2.0), 2.0),  # a step down: the faster of the last two (the mean is 2.29)
        ((4.0, 1.0, 2.0), hm(4.0, 1.0, 2.0)),  # a step down, but the mean (1.71) is lower still
        ((2.0, 100.0, 2.0, 2.0), hm(2.0, 100.0, 2.0, 2.0)),  # last two equal to the slowest older one: no step
        ((4.0, 1.0, 5.0, 4.0, 4.0), hm(4.0, 1.0, 5.0, 4.0, 4.0)),  # a dip long ago
        ((8.0, 8.0, 8.0, 1.0, 8.0), hm(8.0, 8.0, 8.0, 1.0, 8.0)),  # one slow fetch among fast ones: a dip (3.33)
        ((9.0, 0.1, 9.0, 9.0, 9.0, 9.0, 1.0, 1.5), 1.5),  # the window (5) forgets the old 0.1
        ((100.0, 2.0, 2.0), 2.0),  # three samples are enough to see a step (the mean is 2.97)
        ((10.0, 1000.0, 1000.0, 9.0, 10.0), hm(10.0, 1000.0, 1000.0, 9.0, 10.0)),  # one slow, then normal: a dip
        ((100.0, 100.0, 2.0, 2.0, 3.0), hm(100.0, 100.0, 2.0, 2.0, 3.0)),  # as slow as an older one: no step
    ],
)
def test_tail_estimate(samples, want):
    e = fed(*samples)
    assert e.tail_estimate() == pytest.approx(want, rel=1e-12)
    assert e.next_estimate(first_of_load=True) == e.tail_estimate()


def test_a_loads_first_fetch_is_planned_at_the_tail_rate_not_a_stale_slow_sample():
    e = fed(0.4, 0.4, 0.4, 0.4, 0.05)
    assert e.estimate() == pytest.approx(0.05)
    assert e.next_estimate(first_of_load=True) == pytest.approx(hm(0.4, 0.4, 0.4, 0.4, 0.05)) == pytest.approx(1 / 6)
    assert e.next_estimate(first_of_load=False) == pytest.approx(0.05)


def _fetch_s(nbytes: int, latency: float = 0.001, gbps: float = 5.0) -> float:
    return latency + nbytes * 8 / (gbps * 1e9)


def test_latency_is_fitted_to_fetches_of_different_sizes():
    e = ThroughputEstimator()
    sizes = [200_000, 3_000_000, 200_000, 3_000_000, 400_000]
    for b in sizes[:3]:
        e.record_fetch(b, _fetch_s(b))
    assert e.latency(0.0005) == 0.0005  # three fetches: the default
    for b in sizes[3:]:
        e.record_fetch(b, _fetch_s(b))
    assert e.latency(0.0005) == pytest.approx(0.001, rel=1e-9)
    e.record_fetch(200_000, 0.05)  # one stalled fetch moves neither the slope nor the intercept much
    assert e.latency(0.0005) == pytest.approx(0.001, rel=0.05)
    e.reset()
    assert e.latency(0.0005) == 0.0005


def test_latency_keeps_the_default_without_a_fit():
    same = ThroughputEstimator()
    for _ in range(6):
        same.record_fetch(200_000, _fetch_s(200_000))  # one size: latency and rate cannot be told apart
    assert same.latency(0.0007) == 0.0007
    close = ThroughputEstimator()
    for b in (200_000, 300_000, 250_000, 390_000):  # no two sizes twofold apart
        close.record_fetch(b, _fetch_s(b))
    assert close.latency(0.0007) == 0.0007
    faster_when_bigger = ThroughputEstimator()
    for b, t in ((200_000, 0.004), (3_000_000, 0.002), (200_000, 0.004), (3_000_000, 0.002)):
        faster_when_bigger.record_fetch(b, t)
    assert faster_when_bigger.latency(0.0007) == 0.0007
    ignored = ThroughputEstimator()
    for b, t in ((200_000, 0.0), (3_000_000, -1.0), (-5, 0.1), (200_000, 0.001)):
        ignored.record_fetch(b, t)  # not a fetch time, or not a size: not recorded
    assert ignored.latency(0.0007) == 0.0007


def test_latency_is_clamped_to_zero_and_to_the_fastest_fetch():
    negative = ThroughputEstimator()
    for b in (1_000_000, 3_000_000, 1_000_000, 3_000_000):
        negative.record_fetch(b, b * 1e-9 - 0.0005)  # a line through a negative intercept
    assert negative.latency(0.001) == 0.0
    above = ThroughputEstimator()
    for b, t in ((100, 0.010), (1000, 0.011), (100, 0.010), (1000, 0.011)):
        above.record_fetch(b, t)
    assert above.latency(0.001) == pytest.approx(0.0098889, rel=1e-4)  # below the fastest fetch, 10 ms
    above.record_fetch(100, 0.002)  # one fetch faster than the fit (9.9 ms): the latency cannot exceed it
    assert above.latency(0.001) == 0.002


def _theil_sen(f: list[tuple[int, float]], default: float) -> float:
    """The fit ThroughputEstimator.latency documents, written out over itertools.combinations."""
    import itertools
    import statistics

    slopes = [
        (t2 - t1) / (b2 - b1)
        for (b1, t1), (b2, t2) in itertools.combinations(f, 2)
        if b1 != b2 and max(b1, b2) >= 2 * min(b1, b2)
    ]
    if len(f) < 4 or not slopes or statistics.median(slopes) <= 0:
        return default
    c = statistics.median(slopes)
    return min(max(statistics.median(t - b * c for b, t in f), 0.0), min(t for _, t in f))


@pytest.mark.parametrize("seed", range(8))
def test_latency_is_the_documented_fit_over_the_last_16_fetches(seed):
    """Noisy fetches of sizes that are exactly 2x, between 2x and 3x, and further apart: the
    estimator's latency is the Theil-Sen fit over its last 16 (older ones dropped)."""
    import random

    rng = random.Random(seed)
    e = ThroughputEstimator()
    f: list[tuple[int, float]] = []
    for _ in range(rng.randint(16, 30)):
        b = rng.choice([100_000, 200_000, 250_000, 500_000, 3_000_000])
        t = _fetch_s(b, latency=0.001) * rng.uniform(0.8, 1.6)
        e.record_fetch(b, t)
        f.append((b, t))
    assert e.latency(0.0005) == pytest.approx(_theil_sen(f[-16:], 0.0005), rel=1e-12)


def test_a_zero_byte_fetch_counts_and_a_non_fetch_does_not():
    e = ThroughputEstimator()
    for b in (0, 0, 1_000_000, 1_000_000):  # an empty payload's fetch is all latency
        e.record_fetch(b, _fetch_s(b, latency=0.002))
    assert e.latency(0.0005) == pytest.approx(0.002, rel=1e-9)
    for b, t in ((3_000_000, 0.0), (3_000_000, -0.5), (-3_000_000, 0.02), (-1, 0.5)):
        e.record_fetch(b, t)  # no time, or no size: not recorded, the fit is unchanged
    assert e.latency(0.0005) == pytest.approx(0.002, rel=1e-9)


def test_sizes_twofold_or_more_apart_make_a_pair():
    exact = ThroughputEstimator()
    for b in (100_000, 200_000, 100_000, 200_000):  # exactly twofold
        exact.record_fetch(b, _fetch_s(b))
    assert exact.latency(0.0005) == pytest.approx(0.001, rel=1e-9)
    between = ThroughputEstimator()
    for b in (200_000, 500_000, 200_000, 500_000):  # 2.5-fold
        between.record_fetch(b, _fetch_s(b))
    assert between.latency(0.0005) == pytest.approx(0.001, rel=1e-9)


def test_no_slope_keeps_the_default():
    e = ThroughputEstimator()
    for b in (100_000, 1_000_000, 100_000, 1_000_000):
        e.record_fetch(b, 0.003)  # as fast for 1 MB as for 100 KB: the slope is 0
    assert e.latency(0.0005) == 0.0005
