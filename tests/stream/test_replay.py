"""The loader replayed in virtual time (cold start, the rule after text, steps, random traces) and the
planner's decisions it relies on."""

import statistics

import numpy as np

from cachegen.bench.replay import replay_load
from cachegen.stream import LoaderOptions, ThroughputEstimator, decide, make_trace
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.link import Trace
from cachegen.stream.planner import PipelineState, PlanChunk, finish_quantile, simulate

REPLAY = ("estimator", "cpu_noise", "seed", "latency_s", "compute_s")


def replay(chunks, trace, costs, slo_s, **kw):
    """The loader in virtual time; keywords of the replay go to it, the rest into LoaderOptions
    (chunks are planned as given: no recency boost unless asked for)."""
    rk = {k: kw.pop(k) for k in REPLAY if k in kw}
    kw.setdefault("recency_boost", 0)
    return replay_load(chunks, trace, costs, LoaderOptions(slo_s=slo_s, **kw), **rk)


VPT = 11520
COSTS = CostModel(
    decode_s_per_mvalue={},
    decode_s_per_mvalue_default=0.009,
    decode_fixed_s=0.002,
    recompute_fixed_s=0.01,
    recompute_s_per_token=2e-3,
    recompute_s_per_token_ctx=1e-6,
    fetch_latency_s=0.001,
)
BITS = {1: 6.0, 2: 4.5, 3: 3.5, 4: 2.8, 5: 2.2, 6: 1.6, 7: 1.1}  # roughly the codec's ladder


def chunks(n=16, tokens=256):
    return [
        PlanChunk(i, i * tokens, tokens, tokens * VPT, {l: int(tokens * VPT * b / 8) for l, b in BITS.items()})
        for i in range(n)
    ]


def kw(est, **k):
    d = dict(
        time_left_s=10.0,
        cpu_busy_s=0.0,
        est_gbps=est.estimate(),
        last_gbps=est.last(),
        tail_gbps=est.harmonic_mean(),
        known=est.known,
    )
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
    # a deadline the slow probe (405 KB at 1 Mbit/s: 3.2 s) fits in
    r = replay(cs, tr, COSTS, slo_s=10.0, policy="rule", estimator=ThroughputEstimator(prior_gbps=0.001), cpu_noise=0.0)
    # text, a probe (still slow), text, a probe that sees 10 Gbps, then good levels
    assert r.choices[:4] == [TEXT, 7, TEXT, 7], r.choices
    assert all(c != TEXT and c <= 2 for c in r.choices[4:]), r.choices
    assert not r.result.faults


def test_a_fetch_still_running_at_the_deadline_is_abandoned_in_sim():
    """The loader does not wait for a fetch past the load's limit: it recomputes the rest from text
    then, so the load ends at the limit plus the recompute (exact in virtual time without noise)."""
    cs = chunks(8)
    tr = Trace([(0, 0.001), (2, 10.0)], by="chunk")
    r = replay(cs, tr, COSTS, slo_s=2.0, policy="rule", estimator=ThroughputEstimator(prior_gbps=0.001), cpu_noise=0.0)
    # chunk 0 is recomputed (0.56 s); chunk 1's probe would take 3.2 s: at 2.0 s the loader gives up on it
    assert r.choices == [TEXT] * 8 and r.result.decisions[1].reason == "fault", r.choices
    assert len(r.result.faults) == 1 and "chunk 1" in r.result.faults[0]
    rest = sum(COSTS.recompute_s(c.start, c.num_tokens) for c in cs[1:])
    stitch = COSTS.stitch_s(sum(c.num_values for c in cs), 2)
    assert abs(r.load_s - (2.0 + rest + stitch)) < 1e-9, (r.load_s, 2.0 + rest + stitch)


def test_sim_constant_generous_and_tight():
    cs = chunks()
    tr = make_trace("constant:10", len(cs))
    r = replay(cs, tr, COSTS, slo_s=10.0, estimator=ThroughputEstimator(prior_gbps=10.0), cpu_noise=0.0)
    assert r.choices == [1] * 16 and not r.missed
    tight = simulate(cs, [7] * 16, 0.1, COSTS) * 1.2
    r = replay(
        cs,
        make_trace("constant:0.1", 16),
        COSTS,
        slo_s=tight,
        estimator=ThroughputEstimator(prior_gbps=0.1),
        cpu_noise=0.0,
    )
    assert not r.missed and r.load_s <= tight, (r.load_s, tight, r.choices)
    assert max(c for c in r.choices if c != TEXT) >= 6


def test_sim_step_drop_reacts_within_two_chunks():
    cs = chunks()
    # what a loader that reacts one chunk late needs: L1 at 1 Gbps, one L1 chunk at 0.1, then L7 at 0.1
    slo = (
        simulate(cs, [1] * 9 + [7] * 7, 1.0, COSTS)
        + sum(cs[i].sizes[c] * 8 / 0.1e9 for i, c in [(8, 1)] + [(j, 7) for j in range(9, 16)])
        + 0.05
    )
    r = replay(
        cs, make_trace("step", 16), COSTS, slo_s=slo, estimator=ThroughputEstimator(prior_gbps=1.0), cpu_noise=0.0
    )
    assert not r.missed, (r.load_s, slo, r.choices)
    # chunk 8 is the first slow fetch: the next one is planned at the slow rate for itself but at the
    # window's harmonic mean for the rest (one slow fetch may be a dip); the second slow fetch is a
    # step, and from then on every chunk is planned at the slow rate (measured: 1 x 10, then 6 6 5 5 5 4)
    assert r.choices[:8] == [1] * 8 and (r.choices[10] == TEXT or r.choices[10] >= 3), r.choices


def test_finish_quantile_without_variance_is_the_plain_prediction():
    cs = chunks()
    plan = [3] * 10 + [5] * 6
    st = PipelineState(time_left_s=1.0, cpu_busy_s=0.02)
    spb = 1.0 / 2e9
    fut = np.full((8, 15), spb)
    got = finish_quantile(cs, plan, spb, fut, COSTS, st, 0.9)
    assert abs(got - simulate(cs, plan, 2.0, COSTS, st)) < 1e-12


def test_a_slow_fetch_is_hidden_behind_queued_decoding():
    """What the compute stage already holds absorbs a slow fetch; only the excess is late."""
    cs = chunks(2)
    d = COSTS.decode_s(1, cs[0].num_values)
    slow = np.array([[0.9 * d / (8 * cs[1].sizes[1])]])  # chunk 1's fetch takes 0.9 d
    spb_fast = 1e-15
    busy = PipelineState(time_left_s=1.0, cpu_busy_s=d)
    # chunk 0 arrives at once and queues behind d of work; chunk 1 arrives 0.9 d later: no stall
    assert abs(finish_quantile(cs, [1, 1], spb_fast, slow, COSTS, busy, 0.5) - 3 * d) < 1e-9
    idle = PipelineState(time_left_s=1.0, cpu_busy_s=0.0)
    # with nothing queued the same fetch delays the end by what decoding chunk 0 could not cover
    assert finish_quantile(cs, [1, 1], spb_fast, slow, COSTS, idle, 0.5) < 3 * d


def test_risk_planning_hedges_on_a_jumpy_link_and_not_on_a_steady_one():
    cs = chunks()
    steady, jumpy = ThroughputEstimator(), ThroughputEstimator()
    for g in (0.2,) * 8:  # slow enough that the network, not decoding, sets the pace
        steady.add_gbps(g)
    for g in (0.02, 0.9, 0.05, 0.6, 0.03, 0.8, 0.1, 0.4):
        jumpy.add_gbps(g)
    k = kw(steady, time_left_s=simulate(cs, [3] * 16, 0.2, COSTS) + 0.01)
    assert (
        decide("adaptive", cs, COSTS, history_s_per_bit=steady.s_per_bit_history(), **k)
        == decide("adaptive", cs, COSTS, **k)
        == 3
    )
    k = kw(jumpy, time_left_s=simulate(cs, [3] * 16, min(jumpy.estimate(), jumpy.harmonic_mean()), COSTS) + 0.01)
    plain = decide("adaptive", cs, COSTS, **k)
    hedged = decide("adaptive", cs, COSTS, history_s_per_bit=jumpy.s_per_bit_history(), **k)
    assert hedged != TEXT and hedged > plain
    # deterministic: the futures are seeded by the chunk index
    assert decide("adaptive", cs, COSTS, history_s_per_bit=jumpy.s_per_bit_history(), **k) == hedged


def test_sim_random_trace_risk_planning_and_prefetch_lower_misses():
    cs = chunks()
    traces = [make_trace("random", 16, seed=s) for s in range(150)]
    med = statistics.median(g for t in traces for _, g in t.points)
    slo = simulate(cs, [4] * 16, med, COSTS) + COSTS.stitch_s(sum(c.num_values for c in cs), 2) + 0.05
    miss = {}
    for name, kw_ in (
        ("risk", {"risk_quantile": 0.85}),
        ("plain", {}),
        ("shallow", {"prefetch": 1, "risk_quantile": 0.85}),
        ("rule", {}),
    ):
        est = ThroughputEstimator()
        rs = [
            replay(
                cs,
                t,
                COSTS,
                slo,
                policy="rule" if name == "rule" else "adaptive",
                estimator=est,
                seed=s,
                cpu_noise=0.0,
                **kw_,
            )
            for s, t in enumerate(traces)
        ]
        miss[name] = sum(r.missed for r in rs) / len(rs)
    assert miss["risk"] < miss["plain"] and miss["risk"] < miss["shallow"], miss
    assert miss["risk"] <= miss["rule"], miss


def test_sim_fetches_the_boosted_last_chunk_first():
    cs = chunks()
    r = replay(
        cs,
        make_trace("constant:1", 16),
        COSTS,
        slo_s=10.0,
        estimator=ThroughputEstimator(prior_gbps=1.0),
        cpu_noise=0.0,
        recency_boost=2,
    )
    assert r.fetch_end[15] < r.fetch_end[0] < r.fetch_end[1] and r.choices == [1] * 16 and not r.missed
    cold = replay(
        cs,
        make_trace("constant:1", 16),
        COSTS,
        slo_s=10.0,
        estimator=ThroughputEstimator(),
        cpu_noise=0.0,
        recency_boost=2,
    )
    assert cold.fetch_end[0] < cold.fetch_end[15] < cold.fetch_end[1]  # a cold estimator probes with chunk 0
