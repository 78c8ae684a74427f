"""The loader's measured compute speed (ComputeRates) and the fastest policy planning with it."""

import math

import pytest

from cachegen.bench.replay import replay_load
from cachegen.errors import ConfigError
from cachegen.stream import FASTEST, ComputeRates, CostModel, LoaderOptions, ThroughputEstimator, constant
from cachegen.stream import loader as loader_mod
from cachegen.stream.compute_rates import MAX_RATIO, MIN_RATIO, ScaledCosts
from cachegen.stream.costs import TEXT
from cachegen.stream.planner import PlanChunk

COSTS = CostModel(
    decode_s_per_mvalue={2: 0.080, 1: 0.060, 0: 0.016},  # calibrated while the machine ran slow
    decode_fixed_s=0.002,
    recompute_fixed_s=0.01,
    recompute_s_per_token=4e-3,
    recompute_s_per_token_ctx=1e-6,
    fetch_latency_s=0.0005,
)
# levels 2 and 1: small and slow to decode (the codec's), level 0: big and cheap (raw 8-bit KV)
SIZES = {2: 460_000, 1: 800_000, 0: 3_000_000}
TRUE_S = {2: 0.035, 1: 0.037, 0: 0.010}  # what a decode takes on this machine now


def test_a_level_s_factor_is_the_median_of_its_recent_ratios():
    r = ComputeRates(window=3)
    assert not r.known and r.factor(1) == 1.0 and r.factor(TEXT) == 1.0
    for measured in (0.5, 0.9, 0.6, 0.7):  # the first falls out of the window
        r.observe(1, 1.0, measured)
    assert r.known
    assert r.factor(1) == pytest.approx(0.7)


def test_an_unseen_level_takes_the_pooled_median_and_text_only_its_own():
    r = ComputeRates()
    r.observe(1, 0.1, 0.05)
    r.observe(2, 0.1, 0.07)
    r.observe(2, 0.1, 0.09)
    assert r.factor(5) == pytest.approx(0.7) == r.pooled_factor()
    assert r.factor(TEXT) == 1.0  # a prefill is not a decode
    r.observe(TEXT, 2.0, 3.0)
    assert r.factor(TEXT) == pytest.approx(1.5)
    assert r.pooled_factor() == pytest.approx(0.7)  # recomputes are not pooled with decodes


@pytest.mark.parametrize(
    ("predicted", "measured"), [(0.0, 0.1), (-1.0, 0.1), (0.1, -0.01), (math.nan, 0.1), (0.1, math.inf)]
)
def test_a_sample_that_is_not_a_time_is_ignored(predicted, measured):
    r = ComputeRates()
    r.observe(1, predicted, measured)
    assert not r.known


def test_an_outlier_counts_only_up_to_the_bounds():
    r = ComputeRates()
    r.observe(1, 0.01, 10.0)
    assert r.factor(1) == MAX_RATIO
    r = ComputeRates()
    r.observe(1, 1.0, 0.0)
    assert r.factor(1) == MIN_RATIO


def test_the_window_must_hold_a_sample():
    with pytest.raises(ConfigError, match=r"^window must be >= 1$"):
        ComputeRates(window=0)
    one = ComputeRates(window=1)
    one.observe(1, 1.0, 0.5)
    one.observe(1, 1.0, 0.8)
    assert one.factor(1) == pytest.approx(0.8)


def test_the_default_window_is_the_last_16_decodes():
    r = ComputeRates()
    for measured in [0.5] * 9 + [1.0] * 8:  # the 16 kept: eight of each, median 0.75
        r.observe(1, 1.0, measured)
    assert r.factor(1) == pytest.approx(0.75)


def test_corrected_scales_each_prediction_by_its_factor():
    r = ComputeRates()
    assert r.corrected(COSTS) is COSTS  # nothing measured: the calibrated model itself
    r.observe(1, 1.0, 0.5)
    r.observe(2, 1.0, 0.9)
    r.observe(TEXT, 1.0, 2.0)
    c = r.corrected(COSTS)
    assert isinstance(c, ScaledCosts)
    assert c.decode_s(1, 10**6) == pytest.approx(0.5 * COSTS.decode_s(1, 10**6))
    assert c.decode_s(2, 10**6) == pytest.approx(0.9 * COSTS.decode_s(2, 10**6))
    assert c.decode_s(0, 10**6) == pytest.approx(0.7 * COSTS.decode_s(0, 10**6))  # unseen: pooled
    assert c.recompute_s(256, 256) == pytest.approx(2.0 * COSTS.recompute_s(256, 256))
    assert c.fetch_s(10**6, 1.0) == COSTS.fetch_s(10**6, 1.0)  # the link is the estimator's business
    assert COSTS.decode_s(1, 10**6) == pytest.approx(0.062)  # the calibrated model is left alone


def _chunks(n=16, values=10**6):
    return [PlanChunk(i, i * 256, 256, values, dict(SIZES)) for i in range(n)]


def _true_compute(pos, choice):
    if choice == TEXT:
        return COSTS.recompute_s(pos * 256, 256)
    return TRUE_S[int(choice)]


def _load(rates, policy=FASTEST, slo_s=None):
    # 0.1 Gbit/s: a level-2 chunk crosses in 37 ms, a level-1 one in 64 ms, a level-0 one in 240 ms
    opts = LoaderOptions(policy=policy, slo_s=slo_s, recency_boost=0)
    est = ThroughputEstimator(prior_gbps=0.1)
    return replay_load(_chunks(), constant(0.1), COSTS, opts, est, compute_s=_true_compute, rates=rates)


class _Forgetful(ComputeRates):
    """Rates that never learn: the loader plans with the calibrated model throughout."""

    def observe(self, choice, predicted_s, measured_s, fetch_cpu_s=0.0):
        pass


def test_the_fastest_policy_learns_that_decoding_is_not_the_bottleneck():
    """Calibrated, level 2 decodes much slower (82 ms) than it crosses the link (37 ms), so the
    plan takes bigger level-1 chunks, cheaper to decode by the model; measured, both decode in
    35-37 ms: the link is the bottleneck and level 2 alone ends the load soonest. A first load
    learns as it goes; the second, with the rates the first one left, takes level 2 throughout."""
    blind = _load(_Forgetful())
    assert blind.choices.count(1) >= 4  # the calibrated model's choice
    rates = ComputeRates()
    first = _load(rates)
    assert rates.factor(2) == pytest.approx(0.035 / COSTS.decode_s(2, 10**6), rel=1e-3)
    second = _load(rates)
    assert second.choices == [2] * 16
    assert second.load_s <= first.load_s < 0.8 * blind.load_s


def test_a_deadline_policy_plans_with_the_calibrated_model(monkeypatch):
    """The rates are learned under every policy, but only the fastest one plans with them: a
    deadline policy keeps the calibrated headroom (a median is too fast half the time)."""
    rates = ComputeRates()
    _load(rates, policy="adaptive", slo_s=1.5)
    assert rates.known and rates.pooled_factor() < 1.0  # learned from the adaptive load too
    seen: list[tuple[object, object]] = []
    decide = loader_mod.decide

    def spy(policy, remaining, costs, **kw):
        seen.append((policy, costs))
        return decide(policy, remaining, costs, **kw)

    fastest = loader_mod.decide_fastest

    def spy_fastest(remaining, costs, **kw):
        seen.append((FASTEST, costs))
        return fastest(remaining, costs, **kw)

    monkeypatch.setattr(loader_mod, "decide", spy)
    monkeypatch.setattr(loader_mod, "decide_fastest", spy_fastest)
    _load(rates, policy="adaptive", slo_s=1.5)
    _load(rates)
    assert {p for p, _ in seen} == {"adaptive", FASTEST}
    assert all(c is COSTS for p, c in seen if p == "adaptive")
    assert all(
        isinstance(c, ScaledCosts) and c.decode_s(2, 10**6) < COSTS.decode_s(2, 10**6) for p, c in seen if p == FASTEST
    )


def test_the_decode_that_allocates_the_cache_is_not_learned_from():
    """The load's first decode also allocates the whole prefix's cache: its time says nothing
    about the next chunk's."""
    rates = ComputeRates()
    opts = LoaderOptions(policy=2, slo_s=None, recency_boost=0)
    est = ThroughputEstimator(prior_gbps=0.1)

    def slow_first(pos, choice):
        return 10 * TRUE_S[2] if pos == 0 else TRUE_S[2]

    replay_load(_chunks(2), constant(0.1), COSTS, opts, est, compute_s=slow_first, rates=rates)
    assert rates.factor(2) == pytest.approx(TRUE_S[2] / COSTS.decode_s(2, 10**6), rel=1e-3)


def test_recomputes_teach_the_text_factor_alone():
    rates = ComputeRates()
    opts = LoaderOptions(policy=TEXT, slo_s=None, recency_boost=0)
    est = ThroughputEstimator(prior_gbps=0.1)

    def twice(pos, choice):  # every recompute takes twice its prediction
        return 2 * COSTS.recompute_s(pos * 256, 256)

    replay_load(_chunks(4), constant(0.1), COSTS, opts, est, compute_s=twice, rates=rates)
    assert rates.factor(TEXT) == pytest.approx(2.0, rel=1e-3)
    assert rates.pooled_factor() == 1.0  # no decode was timed


# levels 2 and 1 are two levels of one codec (one decoder); level 0 is another codec's
FAMILIES = {2: "codec/lossy", 1: "codec/lossy", 0: "raw/level 0"}


def test_the_levels_of_a_decoder_family_share_one_factor():
    r = ComputeRates()
    for measured in (0.5, 0.6):
        r.observe(1, 1.0, measured)
    r.observe(2, 1.0, 0.9)
    r.observe(0, 1.0, 2.0)
    r.observe(TEXT, 1.0, 3.0)
    assert r.factor(1) == pytest.approx(0.55) and r.factor(2) == pytest.approx(0.9)  # no families: per level
    assert r.factor(1, FAMILIES) == r.factor(2, FAMILIES) == pytest.approx(0.6)  # the median of 0.5, 0.6, 0.9
    assert r.factor(0, FAMILIES) == pytest.approx(2.0)
    assert r.factor(7, FAMILIES) == r.pooled_factor() == pytest.approx(0.75)  # outside the map: as before
    assert r.factor(TEXT, FAMILIES) == pytest.approx(3.0)


def test_corrected_scales_a_level_by_its_family_and_an_unseen_family_by_the_pool():
    r = ComputeRates()
    r.observe(1, 1.0, 0.5)
    r.observe(0, 1.0, 2.0)
    r.observe(0, 1.0, 2.0)
    fams = {**FAMILIES, 3: "other/level 3"}
    c = r.corrected(COSTS, fams)
    assert c.decode_s(2, 10**6) == pytest.approx(0.5 * COSTS.decode_s(2, 10**6))  # not decoded yet: its family's
    assert c.decode_s(1, 10**6) == pytest.approx(0.5 * COSTS.decode_s(1, 10**6))
    assert c.decode_s(0, 10**6) == pytest.approx(2.0 * COSTS.decode_s(0, 10**6))
    assert c.decode_s(3, 10**6) == pytest.approx(2.0 * COSTS.decode_s(3, 10**6))  # a family not seen: the pool
    assert r.corrected(COSTS).decode_s(2, 10**6) == pytest.approx(2.0 * COSTS.decode_s(2, 10**6))  # per level


def _fixed_then_fastest(families):
    """Loads at level 1 and at level 0 teach the rates; then a fastest load plans with them. Truly
    levels 2 and 1 decode alike (35-37 ms, well under their calibrated 82 and 62 ms) and level 0
    slower than calibrated (30 ms against 18 ms)."""
    true_s = {2: 0.035, 1: 0.037, 0: 0.030}
    rates = ComputeRates()
    for level in (1, 0):
        opts = LoaderOptions(policy=level, slo_s=None, recency_boost=0)
        replay_load(
            _chunks(),
            constant(0.1),
            COSTS,
            opts,
            ThroughputEstimator(prior_gbps=0.1),
            compute_s=lambda p, c: true_s[int(c)],
            rates=rates,
            families=families,
        )
    opts = LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0)
    est = ThroughputEstimator(prior_gbps=0.1)
    return replay_load(
        _chunks(),
        constant(0.1),
        COSTS,
        opts,
        est,
        compute_s=lambda p, c: true_s[int(c)],
        rates=rates,
        families=families,
    )


def test_a_level_not_decoded_yet_takes_its_decoder_family_s_speed():
    """Level 2 has never been decoded. Pooled with raw 8-bit KV's decodes (slower than calibrated),
    its factor says 93 ms a chunk, and the plan starts with level 1 (64 ms on the link). Its
    family's factor, learned from level 1, says 49 ms: level 2 (37 ms on the link) from the first
    chunk, and the load ends sooner."""
    pooled = _fixed_then_fastest(None)
    family = _fixed_then_fastest(FAMILIES)
    assert pooled.choices[:3] == [1, 1, 1]
    assert family.choices[:15] == [2] * 15
    assert family.load_s < 0.95 * pooled.load_s


def test_the_project_codec_and_a_ladder_name_their_decoder_families():
    from cachegen.bench.baselines.uniform import UniformCodec
    from cachegen.codec import Codec
    from cachegen.stream import FormatLadder, Rung
    from cachegen.stream.compute_rates import decoder_families

    codec = Codec(threads=1)
    fams = decoder_families(codec)
    assert fams[0] == "lossless" and {fams[lv] for lv in codec.levels if lv} == {"lossy"}
    ladder = FormatLadder(
        [Rung("u8", UniformCodec(8), 0), Rung("L4", codec, 4), Rung("L7", codec, 7), Rung("L0", codec, 0)]
    )
    assert decoder_families(ladder) == {
        0: "uniform8/level 0",
        1: "cachegen/lossy",
        2: "cachegen/lossy",
        3: "cachegen/lossless",
    }
    assert decoder_families(object()) == {}  # lists no levels
