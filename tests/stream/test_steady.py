"""The fastest policy keeping a steady choice a few chunks without deciding again: when the planner
calls a choice steady, and when the loader keeps it or decides again."""

from __future__ import annotations

import pytest

from cachegen.bench.replay import replay_load
from cachegen.errors import ConfigError
from cachegen.stream import LoaderOptions, ThroughputEstimator, constant
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.link import Trace
from cachegen.stream.planner import FASTEST, PipelineState, PlanChunk, choose_fastest, decide_fastest

# raw 8-bit KV (level 0) decodes fast and is big, the compact levels small and slow to decode
COSTS = CostModel(
    decode_s_per_mvalue={0: 0.002, 1: 0.004, 4: 0.009, 7: 0.010},
    decode_fixed_s=0.002,
    recompute_fixed_s=0.01,
    recompute_s_per_token=2e-3,
    recompute_s_per_token_ctx=1e-6,
    fetch_latency_s=0.001,
)
VPT = 11520
BITS = {0: 8.0, 1: 6.0, 4: 2.8, 7: 1.1}


def chunks(n: int = 16, tokens: int = 256, bits=BITS) -> list[PlanChunk]:
    return [
        PlanChunk(i, i * tokens, tokens, tokens * VPT, {l: int(tokens * VPT * b / 8) for l, b in bits.items()})
        for i in range(n)
    ]


# -- the planner ----------------------------------------------------------------------------


# 8-bit KV and a compact level that take turns as the bottleneck around 1 Gbit/s
PAIR = CostModel(
    decode_s_per_mvalue={0: 0.0015, 7: 0.006}, decode_fixed_s=0.001, fetch_latency_s=0.0003, recompute_fixed_s=1.0
)
PAIR_BITS = {0: 8.0, 7: 1.1}


def test_a_format_best_for_every_chunk_is_steady_and_one_a_mix_beats_is_not():
    st = PipelineState(float("inf"))
    assert choose_fastest(chunks(), 0.1, COSTS, st).steady  # L7 for every chunk
    cs = chunks(bits=PAIR_BITS)
    fast = choose_fastest(cs, 5.0, PAIR, st)
    assert fast.choice == 0 and fast.steady
    mixed = choose_fastest(cs, 1.0, PAIR, st)
    assert mixed.choice == 7 and not mixed.steady  # some later chunks are predicted at 8-bit KV


def test_a_cold_estimator_s_probe_and_an_unstored_chunk_are_never_steady():
    kw = dict(time_left_s=None, cpu_busy_s=0.0, est_gbps=0.1, tail_gbps=0.1)
    assert decide_fastest(chunks(), COSTS, known=True, **kw) == (7, True)
    assert decide_fastest(chunks(), COSTS, known=False, **kw) == (7, False)
    bare = [PlanChunk(0, 0, 256, 256 * VPT, {}), *chunks()[1:]]
    assert decide_fastest(bare, COSTS, known=True, **kw) == (TEXT, False)


# -- the loader -----------------------------------------------------------------------------


def _replay(trace: Trace, steady: int = 3, gbps: float = 1.0, **kw):
    opts = LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0, steady_chunks=steady)
    return replay_load(chunks(), trace, COSTS, opts, ThroughputEstimator(prior_gbps=gbps), cpu_noise=0.0, **kw)


@pytest.mark.parametrize("gbps", [0.1, 10.0])
def test_on_a_steady_link_three_chunks_of_four_keep_the_choice_and_the_plan_is_the_same(gbps):
    """In virtual time a decision costs nothing, so keeping a steady choice changes only how many
    decisions are made: one every four chunks, and the same plan and load time."""
    on = _replay(constant(gbps), gbps=gbps)
    off = _replay(constant(gbps), steady=0, gbps=gbps)
    assert on.result is not None and off.result is not None
    assert [d.kept for d in on.result.decisions] == [False, True, True, True] * 4
    assert not any(d.kept for d in off.result.decisions)
    assert on.choices == off.choices and len(set(on.choices)) == 1
    assert on.load_s == pytest.approx(off.load_s)


def test_a_kept_choice_is_dropped_when_the_link_drops():
    """The link drops from 10 to 0.1 Gbit/s at chunk 6. The chunk after the one that measured the
    drop is decided again, as it is when every chunk is decided, and the plan moves to the compact
    level at once."""
    step = Trace([(0, 10.0), (6, 0.1)], by="chunk")
    on = _replay(step, gbps=10.0)
    off = _replay(step, steady=0, gbps=10.0)
    assert on.result is not None
    assert on.choices == off.choices
    assert on.choices[:6] == [0] * 6 and on.choices[7:] == [7] * 9
    assert on.result.decisions[7].kept is False


def test_a_mix_is_decided_chunk_by_chunk():
    opts = LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0)
    est = ThroughputEstimator(prior_gbps=1.0)
    res = replay_load(chunks(bits=PAIR_BITS), constant(1.0), PAIR, opts, est, cpu_noise=0.0)
    assert res.result is not None and set(res.choices) == {0, 7}
    assert sum(d.kept for d in res.result.decisions) <= 1


def test_other_policies_never_keep_and_a_negative_count_is_refused():
    for policy in ("adaptive", 4):
        opts = LoaderOptions(policy=policy, slo_s=1.0, recency_boost=0)
        res = replay_load(chunks(), constant(1.0), COSTS, opts, ThroughputEstimator(prior_gbps=1.0), cpu_noise=0.0)
        assert res.result is not None and not any(d.kept for d in res.result.decisions)
    with pytest.raises(ConfigError, match=r"^steady_chunks must be >= 0$"):
        LoaderOptions(steady_chunks=-1)


def test_what_the_fastest_decision_is_given(monkeypatch):
    """Each decision gets the time left to the deadline, the link's estimates as they stand, the
    previous choice and the allowed levels; each chunk records the estimate it was decided on."""
    from cachegen.stream import loader as loader_mod

    est = ThroughputEstimator(prior_gbps=0.5)
    seen: list[dict] = []
    real = loader_mod.decide_fastest

    def spy(remaining, costs, **kw):
        assert kw["est_gbps"] == est.next_estimate(first_of_load=kw["prev"] is None)
        assert kw["tail_gbps"] == est.tail_estimate()
        seen.append(kw)
        return real(remaining, costs, **kw)

    monkeypatch.setattr(loader_mod, "decide_fastest", spy)
    opts = LoaderOptions(policy=FASTEST, slo_s=2.0, recency_boost=0, levels=(0, 7), steady_chunks=0)
    rise = Trace([(0, 0.5), (4, 2.0)], by="chunk")  # the latest sample and the estimate part ways
    res = replay_load(chunks(), rise, COSTS, opts, est, cpu_noise=0.0)
    assert res.result is not None and len(seen) == 16
    assert [kw["prev"] for kw in seen] == [None, *res.choices[:-1]]
    assert all(kw["allowed"] == (0, 7) for kw in seen)
    lefts = [kw["time_left_s"] for kw in seen]
    assert 0 < lefts[-1] < lefts[0] <= 2.0
    assert [d.est_gbps for d in res.result.decisions] == [kw["est_gbps"] for kw in seen]
    assert len({kw["est_gbps"] for kw in seen}) > 2
    seen.clear()
    replay_load(chunks(), rise, COSTS, LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0), est, cpu_noise=0.0)
    assert seen and all(kw["time_left_s"] is None for kw in seen)


def test_a_small_relative_move_of_a_slow_link_ends_the_kept_choice():
    """At 0.1 Gbit/s a drop to 0.05 moves the estimate by half (the tolerance is relative); its
    window's mean moves less, and the chunk after the slow fetch is decided again all the same."""
    step = Trace([(0, 0.1), (5, 0.05)], by="chunk")
    res = _replay(step, gbps=0.1)
    assert res.result is not None
    kept = [d.kept for d in res.result.decisions]
    assert kept[:5] == [False, True, True, True, False] and kept[6] is False


def test_a_kept_choice_that_a_chunk_does_not_store_is_decided_again():
    cs = chunks()
    cs[2] = PlanChunk(2, cs[2].start, 256, 256 * VPT, {l: s for l, s in cs[2].sizes.items() if l != 7})
    opts = LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0)
    res = replay_load(cs, constant(0.1), COSTS, opts, ThroughputEstimator(prior_gbps=0.1), cpu_noise=0.0)
    assert res.result is not None and not res.result.faults
    assert res.choices[1] == 7 and res.choices[2] != 7
    assert [d.kept for d in res.result.decisions[:3]] == [False, True, False]


def test_recomputing_every_chunk_is_never_kept():
    """Where recompute is far cheaper than any fetch, every chunk is recomputed, each decided (text
    is no format to keep: a plan of text is not a plan of one format) with the estimate it records."""
    cheap = CostModel(
        decode_s_per_mvalue=COSTS.decode_s_per_mvalue,
        recompute_fixed_s=0.0,
        recompute_s_per_token=1e-6,
        recompute_s_per_token_ctx=0.0,
    )
    opts = LoaderOptions(policy=FASTEST, slo_s=None, recency_boost=0)
    res = replay_load(chunks(), constant(0.01), cheap, opts, ThroughputEstimator(prior_gbps=0.01), cpu_noise=0.0)
    assert res.result is not None and set(res.choices) == {TEXT}
    assert not any(d.kept for d in res.result.decisions)
    assert all(d.est_gbps == 0.01 for d in res.result.decisions)
