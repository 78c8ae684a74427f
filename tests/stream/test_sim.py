"""Round-2 behaviour: cold start, the rule after text, the virtual-time replay, bench helpers."""

import statistics

from cachegen.stream import ThroughputEstimator, decide, make_trace, simulate_load
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.link import Trace
from cachegen.stream.planner import PlanChunk, simulate

VPT = 11520
COSTS = CostModel(decode_s_per_mvalue={}, decode_s_per_mvalue_default=0.009, decode_fixed_s=0.002,
                  recompute_fixed_s=0.01, recompute_s_per_token=2e-3, recompute_s_per_token_ctx=1e-6,
                  fetch_latency_s=0.001)
BITS = {1: 6.0, 2: 4.5, 3: 3.5, 4: 2.8, 5: 2.2, 6: 1.6, 7: 1.1}  # roughly the codec's ladder


def chunks(n=16, tokens=256):
    return [PlanChunk(i, i * tokens, tokens, tokens * VPT, {l: int(tokens * VPT * b / 8) for l, b in BITS.items()})
            for i in range(n)]


def kw(est, **k):
    d = dict(time_left_s=10.0, cpu_busy_s=0.0, est_gbps=est.estimate(), last_gbps=est.last(),
             tail_gbps=est.harmonic_mean(), known=est.known)
    d.update(k)
    return d


def test_cold_estimator_probes_with_smallest_level():
    cs = chunks()
    cold = ThroughputEstimator()
    assert not cold.known
    assert decide("adaptive", cs, COSTS, **kw(cold)) == 7
    assert decide("rule", cs, COSTS, share_s=1.0, **kw(cold)) == 7
    warm = ThroughputEstimator(prior_gbps=10.0)  # an explicit prior is trusted
    assert warm.known and decide("adaptive", cs, COSTS, **kw(warm)) == 1
    cold.add(10**6, 0.0008)  # one sample (10 Gbps) and it plans normally
    assert cold.known and decide("adaptive", cs, COSTS, **kw(cold)) == 1


def test_rule_is_not_stranded_on_text():
    cs = chunks()
    est = ThroughputEstimator(prior_gbps=0.0001)  # far too slow for any level: text
    assert decide("rule", cs, COSTS, share_s=0.05, prev=None, **kw(est)) == TEXT
    # after a text chunk there is no new sample: probe with the smallest level instead of text forever
    assert decide("rule", cs[1:], COSTS, share_s=0.05, prev=TEXT, **kw(est)) == 7
    est.add(10**6, 0.001)  # the probe saw 8 Gbps
    assert decide("rule", cs[2:], COSTS, share_s=0.05, prev=7, **kw(est)) not in (TEXT, 7)


def test_rule_recovers_after_bandwidth_returns_in_sim():
    cs = chunks(8)
    tr = Trace([(0, 0.001), (2, 10.0)], by="chunk")
    r = simulate_load(cs, tr, COSTS, slo_s=2.0, policy="rule", estimator=ThroughputEstimator(prior_gbps=0.001),
                      cpu_noise=0.0)
    # text, a probe (still slow), text, a probe that sees 10 Gbps, then good levels
    assert r.choices[:4] == [TEXT, 7, TEXT, 7], r.choices
    assert all(c != TEXT and c <= 2 for c in r.choices[4:]), r.choices


def test_sim_constant_generous_and_tight():
    cs = chunks()
    tr = make_trace("constant:10", len(cs))
    r = simulate_load(cs, tr, COSTS, slo_s=10.0, estimator=ThroughputEstimator(prior_gbps=10.0), cpu_noise=0.0)
    assert r.choices == [1] * 16 and not r.missed
    tight = simulate(cs, [7] * 16, 0.1, COSTS) * 1.2
    r = simulate_load(cs, make_trace("constant:0.1", 16), COSTS, slo_s=tight,
                      estimator=ThroughputEstimator(prior_gbps=0.1), cpu_noise=0.0)
    assert not r.missed and r.load_s <= tight, (r.load_s, tight, r.choices)
    assert max(c for c in r.choices if c != TEXT) >= 6


def test_sim_step_drop_reacts_within_one_chunk():
    cs = chunks()
    # what a loader that reacts one chunk late needs: L1 at 1 Gbps, one L1 chunk at 0.1, then L7 at 0.1
    slo = simulate(cs, [1] * 9 + [7] * 7, 1.0, COSTS) + sum(
        cs[i].sizes[c] * 8 / 0.1e9 for i, c in [(8, 1)] + [(j, 7) for j in range(9, 16)]) + 0.05
    r = simulate_load(cs, make_trace("step", 16), COSTS, slo_s=slo, estimator=ThroughputEstimator(prior_gbps=1.0),
                      cpu_noise=0.0)
    assert not r.missed, (r.load_s, slo, r.choices)
    assert r.choices[:8] == [1] * 8 and all(c == TEXT or c >= 3 for c in r.choices[9:]), r.choices


def test_guard_keeps_chunks_recoverable():
    cs = chunks()
    est = ThroughputEstimator(prior_gbps=1.0)
    for g in (5.0, 0.1, 5.0, 5.0, 5.0, 5.0, 5.0):  # one slow fetch in the history
        est.add_gbps(g)
    k = kw(est, time_left_s=simulate(cs, [7] * 16, 5.0, COSTS) + 0.06)
    unguarded = decide("adaptive", cs, COSTS, **k)
    guarded = decide("adaptive", cs, COSTS, worst_gbps=est.low(), **k)
    assert est.low() == 0.1 and guarded > unguarded  # a smaller payload, in case this fetch is that slow


def test_sim_random_trace_guard_lowers_misses():
    cs = chunks()
    traces = [make_trace("random", 16, seed=s) for s in range(120)]
    med = statistics.median(g for t in traces for _, g in t.points)
    slo = simulate(cs, [4] * 16, med, COSTS) + 0.05
    miss = {}
    for policy, guard in (("adaptive", True), ("adaptive", False), ("rule", False)):
        est = ThroughputEstimator()
        rs = [simulate_load(cs, t, COSTS, slo, policy=policy, estimator=est, seed=s, guard=guard, spread=False,
                            cpu_noise=0.0)
              for s, t in enumerate(traces)]
        miss[policy, guard] = sum(r.missed for r in rs) / len(rs)
    assert miss["adaptive", True] < miss["adaptive", False] <= miss["rule", False] + 0.02, miss


def test_spread_is_the_std_of_seconds_per_bit():
    est = ThroughputEstimator()
    for g in (1.0, 1.0, 1.0):
        est.add_gbps(g)
    assert est.spread() is None  # too few samples to say
    est.add_gbps(1.0)
    assert est.spread() == 0.0  # a steady link: no margin
    est.add_gbps(0.5)
    x = [1e-9] * 4 + [2e-9]
    m = sum(x) / 5
    assert abs(est.spread() - (sum((v - m) ** 2 for v in x) / 4) ** 0.5) < 1e-21


def test_spread_margin_picks_smaller_levels_and_vanishes_on_a_steady_link():
    cs = chunks()
    steady, jumpy = ThroughputEstimator(), ThroughputEstimator()
    for g in (0.2,) * 8:  # slow enough that the network, not decoding, sets the pace
        steady.add_gbps(g)
    for g in (0.02, 0.9, 0.05, 0.6, 0.03, 0.8, 0.1, 0.4):
        jumpy.add_gbps(g)
    k = kw(steady, time_left_s=simulate(cs, [3] * 16, 0.2, COSTS) + 0.01)
    assert decide("adaptive", cs, COSTS, spread_s_per_bit=steady.spread(), **k) == decide("adaptive", cs, COSTS, **k)
    k = kw(jumpy, time_left_s=simulate(cs, [3] * 16, min(jumpy.estimate(), jumpy.harmonic_mean()), COSTS) + 0.01)
    plain = decide("adaptive", cs, COSTS, **k)
    hedged = decide("adaptive", cs, COSTS, spread_s_per_bit=jumpy.spread(), **k)
    assert hedged != TEXT and hedged > plain


def test_sim_random_trace_spread_lowers_misses():
    cs = chunks()
    traces = [make_trace("random", 16, seed=s) for s in range(120)]
    med = statistics.median(g for t in traces for _, g in t.points)
    slo = simulate(cs, [4] * 16, med, COSTS) + 0.05
    miss = {}
    for spread in (True, False):
        est = ThroughputEstimator()
        rs = [simulate_load(cs, t, COSTS, slo, estimator=est, seed=s, spread=spread, cpu_noise=0.0)
              for s, t in enumerate(traces)]
        miss[spread] = sum(r.missed for r in rs) / len(rs)
    assert miss[True] < miss[False], miss
