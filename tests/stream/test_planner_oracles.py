"""The planner's secondary rules (the safety factor, the tail rate, recompute in the cheapest tail)
against oracles that do not use the planner: the loader itself in virtual time (exact, no noise) and
a brute force over every plan of a few chunks, timed by :func:`pipeline_end`, a two-stage pipeline
written here from the loader's description. Tolerances are float round-off, not slack."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cachegen.bench.replay import replay_load
from cachegen.stream import LoaderOptions, ThroughputEstimator, constant, decide
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.planner import (
    PipelineState,
    PlanChunk,
    choose_adaptive,
    fetch_order,
    finish_quantile,
    lift,
    smallest_level,
    with_recency_boost,
)

DECODE_S = 0.002
RECOMPUTE_FIXED_S = 0.01
RECOMPUTE_S_PER_TOKEN = 1e-3
# no per-value decode cost, no attention term, no request latency: every time below is a sum of
# a few numbers the test states (num_values 0 also makes the stitch free)
COSTS = CostModel(
    decode_s_per_mvalue={},
    decode_s_per_mvalue_default=0.0,
    decode_fixed_s=DECODE_S,
    recompute_fixed_s=RECOMPUTE_FIXED_S,
    recompute_s_per_token=RECOMPUTE_S_PER_TOKEN,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)
TOKENS = 256
SIZES = {1: 250_000, 2: 125_000, 3: 62_500}  # bytes per chunk and level: at 0.1 Gbit/s 20, 10 and 5 ms
G = 0.1


def make_chunks(n: int, sizes: dict[int, int] = SIZES, tokens: int = TOKENS) -> list[PlanChunk]:
    return [PlanChunk(i, i * tokens, tokens, 0, dict(sizes)) for i in range(n)]


def recompute_s(chunk: PlanChunk) -> float:
    return RECOMPUTE_FIXED_S + chunk.num_tokens * RECOMPUTE_S_PER_TOKEN


def pipeline_end(chunks, plan, head_gbps: float, tail_gbps: float | None = None, cpu0: float = 0.0) -> float:
    """When the compute stage finishes ``plan``: payloads cross the link one after another, back to
    back; the compute stage takes the chunks in order, a fetched one once it has arrived and the one
    before it is done, a recomputed one once the one before it is done. The first chunk's fetch runs
    at ``head_gbps``, the others' at ``tail_gbps``; ``cpu0``: compute work already queued."""
    tail_gbps = head_gbps if tail_gbps is None else tail_gbps
    link_free, compute_free = 0.0, cpu0
    for j, (c, o) in enumerate(zip(chunks, plan)):
        if o == TEXT:
            compute_free += recompute_s(c)
            continue
        link_free += c.sizes[o] * 8 / ((head_gbps if j == 0 else tail_gbps) * 1e9)
        compute_free = max(compute_free, link_free) + DECODE_S
    return compute_free


def replay(chunks, gbps: float, **options):
    options.setdefault("recency_boost", 0)
    est = ThroughputEstimator(prior_gbps=gbps, min_bytes=0)
    return replay_load(chunks, constant(gbps), COSTS, LoaderOptions(**options), estimator=est, cpu_noise=0.0)


@pytest.mark.parametrize("policy", [1, 2, 3, TEXT])
def test_the_oracle_is_the_loader_in_virtual_time(policy):
    """:func:`pipeline_end` is what the loader does: a fixed level for every chunk, no deadline."""
    cs = make_chunks(4)
    r = replay(cs, G, policy=policy, slo_s=None)
    assert r.choices == [policy] * 4
    assert r.result.load_s == pytest.approx(pipeline_end(cs, [policy] * 4, G), abs=1e-12)
    assert r.load_s == pytest.approx(r.result.load_s, abs=1e-12)  # no values: the stitch is free


@pytest.mark.parametrize("safety", [1.0, 0.8, 0.5])
@pytest.mark.parametrize("level", [1, 2])
def test_the_safety_factor_sets_the_threshold_of_each_level(safety, level):
    """The first chunk takes ``level`` exactly when its even plan ends within ``safety`` x the deadline:
    a millionth above that deadline it does, a millionth below it takes the next level."""
    cs = make_chunks(4)
    even = pipeline_end(cs, [level] * 4, G)
    for slo, want in ((even / safety * (1 + 1e-6), level), (even / safety * (1 - 1e-6), level + 1)):
        r = replay(cs, G, slo_s=slo, safety=safety)
        assert r.choices[0] == want, (safety, level, slo, r.choices)
        assert not r.result.faults and r.result.load_s <= slo  # the truth is the model: never late


def test_a_lower_safety_leaves_the_time_unused():
    """With safety 0.5 and a deadline twice the lossless plan's time, the load at the best level ends
    at half the deadline: each later chunk is again planned within half of the time left."""
    cs = make_chunks(4)
    best = pipeline_end(cs, [1] * 4, G)
    r = replay(cs, G, slo_s=2 * best * (1 + 1e-6), safety=0.5)
    assert r.choices == [1] * 4
    assert r.result.load_s == pytest.approx(best, abs=1e-12)
    tight = replay(cs, G, slo_s=2 * best * (1 - 1e-6), safety=0.5)
    assert tight.choices[0] == 2 and tight.result.load_s < best


def _thresholds(chunks, head_gbps, tail_gbps):
    """Deadlines just below and just above each level's even-plan time (the interesting budgets)."""
    out = []
    for lv in sorted(chunks[0].sizes):
        t = pipeline_end(chunks, [lv] * len(chunks), head_gbps, tail_gbps)
        out += [t * (1 - 1e-9), t * (1 + 1e-9)]
    return out


@pytest.mark.parametrize(("head_gbps", "tail_gbps"), [(G, G), (1.0, 0.05), (0.05, 1.0), (0.4, 0.1)])
def test_the_even_plan_prices_later_chunks_at_the_tail_rate(head_gbps, tail_gbps):
    """decide() as the loader calls it: the best level whose even plan, the next fetch at the estimate
    and the rest at the tail rate, ends in time (recompute is slower than any fetch here)."""
    cs = make_chunks(5)
    for budget in _thresholds(cs, head_gbps, tail_gbps):
        fits = [lv for lv in sorted(SIZES) if pipeline_end(cs, [lv] * 5, head_gbps, tail_gbps) <= budget]
        got = decide(
            "adaptive",
            cs,
            COSTS,
            time_left_s=budget,
            cpu_busy_s=0.0,
            est_gbps=head_gbps,
            last_gbps=head_gbps,
            tail_gbps=tail_gbps,
            known=True,
        )
        if fits:
            assert got == fits[0], (budget, fits, got)
        else:
            assert got == 3  # nothing fits: the fastest plan, the smallest level everywhere


# -- recompute in the cheapest tail ------------------------------------------------------------
# Chunks of 100 tokens (recompute: 110 ms). The next fetch is fast (10 Mbit/s: level 1 in 40 ms,
# level 2 in 20 ms), the later ones slow (1 Mbit/s: 400 and 200 ms). No even plan fits 0.3 s, and
# the fastest way to finish after the first chunk mixes recompute and fetching.
HEAD_GBPS, TAIL_GBPS = 0.01, 0.001
SLOW_SIZES = {1: 50_000, 2: 25_000}
SHORT = 100


def brute_force(chunks, head, head_gbps, tail_gbps, cpu0=0.0) -> tuple[float, tuple]:
    """The fastest finish over every plan of the later chunks (each a level or text) after ``head``."""
    opts = [*sorted(chunks[0].sizes), TEXT]
    return min(
        (
            (pipeline_end(chunks, (head, *tail), head_gbps, tail_gbps, cpu0), tail)
            for tail in itertools.product(opts, repeat=len(chunks) - 1)
        ),
        key=lambda x: x[0],
    )


def test_the_cheapest_tail_recomputes_where_that_is_faster():
    cs = make_chunks(3, SLOW_SIZES, SHORT)
    assert all(pipeline_end(cs, [lv] * 3, HEAD_GBPS, TAIL_GBPS) > 0.3 for lv in SLOW_SIZES)
    best, tail = brute_force(cs, 1, HEAD_GBPS, TAIL_GBPS)
    assert tail == (TEXT, 2) and best == pytest.approx(0.242, abs=1e-12)  # recompute chunk 1, fetch 2 meanwhile
    p = choose_adaptive(cs, HEAD_GBPS, COSTS, PipelineState(time_left_s=0.3), tail_gbps=TAIL_GBPS)
    assert p.choice == 1 and p.fits
    assert p.total_s == pytest.approx(best, abs=1e-12)
    assert p.finish_s == pytest.approx(pipeline_end(cs[:1], [1], HEAD_GBPS), abs=1e-12)
    # what the loader calls gives the same, and the safety factor shrinks the same budget
    kw = dict(cpu_busy_s=0.0, est_gbps=HEAD_GBPS, last_gbps=HEAD_GBPS, tail_gbps=TAIL_GBPS, known=True)
    assert decide("adaptive", cs, COSTS, time_left_s=0.3, **kw) == 1
    assert decide("adaptive", cs, COSTS, time_left_s=best / 0.9 * (1 + 1e-9), safety=0.9, **kw) == 1
    assert decide("adaptive", cs, COSTS, time_left_s=best / 0.9 * (1 - 1e-9), safety=0.9, **kw) == 2


@pytest.mark.parametrize("cpu0", [0.0, 0.05, 0.3])
@pytest.mark.parametrize("budget", [0.05, 0.2, 0.23, 0.25, 0.3, 0.45, 1.0])
def test_the_choice_against_every_plan(budget, cpu0):
    """For each budget and compute backlog, against the oracle: the best level whose even plan fits;
    failing that, the best level that fits with the fastest of all tails; text instead only when it
    ends the first chunk sooner and still fits; when nothing fits, the fastest finish."""
    cs = make_chunks(3, SLOW_SIZES, SHORT)
    st = PipelineState(time_left_s=budget, cpu_busy_s=cpu0)
    p = choose_adaptive(cs, HEAD_GBPS, COSTS, st, tail_gbps=TAIL_GBPS)
    levels = sorted(SLOW_SIZES)
    finish = {h: brute_force(cs, h, HEAD_GBPS, TAIL_GBPS, cpu0)[0] for h in [*levels, TEXT]}
    even = [h for h in levels if pipeline_end(cs, [h] * 3, HEAD_GBPS, TAIL_GBPS, cpu0) <= budget]
    fitting = even or [h for h in levels if finish[h] <= budget]
    if fitting:
        want = fitting[0]
        assert p.fits and p.choice in (want, TEXT), (p, finish)
        if p.choice == TEXT:
            assert cpu0 + recompute_s(cs[0]) <= pipeline_end(cs[:1], [want], HEAD_GBPS, cpu0=cpu0) + 1e-12
            assert finish[TEXT] <= budget
    elif finish[TEXT] <= budget:
        assert p.choice == TEXT and p.fits
    else:
        assert not p.fits and p.total_s == pytest.approx(min(finish.values()), abs=1e-12), (p, finish)


# -- the fetch order, the probe, the decision's short cuts ---------------------------------------


def test_the_fetch_order():
    cs = with_recency_boost(make_chunks(4), 2)
    assert fetch_order(cs, adaptive=True, cold=False) == ([3, 0, 1, 2], 3)  # the boosted last chunk first
    assert fetch_order(cs, adaptive=True, cold=True) == ([0, 3, 1, 2], 3)  # chunk 0 takes the probe
    assert fetch_order(cs[:2], adaptive=True, cold=True) == ([0, 1], None)  # its chunk 1 is not boosted
    two = with_recency_boost(make_chunks(2), 2)
    assert fetch_order(two, adaptive=True, cold=True) == ([1, 0], 1)  # too short to probe first
    assert fetch_order(cs, adaptive=False, cold=False) == ([0, 1, 2, 3], None)  # the rule, fixed levels
    assert fetch_order(make_chunks(4), adaptive=True, cold=False) == ([0, 1, 2, 3], None)  # no boost
    unstored = [*cs[:3], PlanChunk(3, 3 * TOKENS, TOKENS, 0, {}, boost=2)]
    assert fetch_order(unstored, adaptive=True, cold=False) == ([0, 1, 2, 3], None)  # nothing to fetch early
    assert fetch_order(with_recency_boost(make_chunks(1), 2), adaptive=True, cold=False) == ([0], None)
    assert with_recency_boost([], 2) == [] and with_recency_boost(make_chunks(2), 0) == make_chunks(2)


def test_lift_stays_among_the_stored_and_allowed_levels():
    c = with_recency_boost(make_chunks(1), 1)[0]
    assert [lift(c, lv) for lv in (1, 2, 3)] == [1, 1, 2]
    assert lift(c, 3, allowed=(1, 3)) == 1 and lift(c, 2, allowed=(1, 3)) == 2  # 2 is not allowed: left alone
    assert lift(make_chunks(1)[0], 3) == 3


def kw(**k):
    d = dict(time_left_s=1.0, cpu_busy_s=0.0, est_gbps=G, last_gbps=G, tail_gbps=G, known=True)
    d.update(k)
    return d


def test_decide_short_cuts():
    cs = make_chunks(3)
    unstored = [PlanChunk(0, 0, TOKENS, 0, {}), *cs[1:]]
    assert decide("adaptive", unstored, COSTS, **kw()) == TEXT
    assert decide(TEXT, cs, COSTS, **kw()) == TEXT
    assert decide(2, cs, COSTS, **kw()) == 2 and decide(5, cs, COSTS, **kw()) == TEXT  # a fixed level not stored
    assert decide("adaptive", cs, COSTS, **kw(time_left_s=None)) == 1  # no deadline: the best level
    assert decide("adaptive", cs, COSTS, allowed=(2, 3), **kw(time_left_s=None)) == 2
    assert decide("adaptive", cs, COSTS, allowed=(9,), **kw(time_left_s=None)) == TEXT
    assert decide("adaptive", cs, COSTS, allowed=(9,), **kw()) == TEXT  # no allowed level to probe with
    assert decide("rule", cs, COSTS, allowed=(9,), **kw()) == TEXT


def test_the_probe_is_the_smallest_payload():
    c = PlanChunk(0, 0, TOKENS, 0, {1: 300, 2: 100, 3: 100, 4: 200})
    assert smallest_level(c) == 3  # a tie goes to the more aggressive level
    assert smallest_level(c, allowed=(1, 4)) == 4 and smallest_level(c, allowed=(7,)) is None
    cs = [c, *make_chunks(3)[1:]]
    for policy in ("adaptive", "rule"):
        assert decide(policy, cs, COSTS, share_s=1.0, **kw(known=False)) == 3  # cold: the probe
    assert decide("rule", cs, COSTS, share_s=1.0, prev=TEXT, **kw()) == 3  # after text: probe again
    assert decide("rule", cs, COSTS, share_s=1.0, prev=1, **kw()) == 1  # warm: the equal share fits level 1
    assert decide("rule", cs, COSTS, **kw()) == TEXT  # no share given: nothing fits 0 s


def test_a_cold_start_recomputes_the_first_chunk_when_that_is_faster():
    """Cold, on a dead link (1 kbit/s): the first chunk of a context is recomputed (nothing before it
    is needed); a later chunk still takes the probe, whose fetch measures the link."""
    first = make_chunks(3)
    assert decide("adaptive", first, COSTS, **kw(known=False, est_gbps=1e-6)) == TEXT
    assert decide("adaptive", first, COSTS, **kw(known=False)) == 3  # at 0.1 Gbit/s the probe is faster
    later = make_chunks(4)[1:]
    assert decide("adaptive", later, COSTS, **kw(known=False, est_gbps=1e-6)) == 3


LATENCY_S = 0.001


def test_finish_quantile_against_the_oracle():
    """Two futures, a fast and a slow link after the first chunk: the 0 and 1 quantiles are the two
    finishes (the oracle, each request paying the latency), the median their mean."""
    costs = CostModel(**{**COSTS.__dict__, "fetch_latency_s": LATENCY_S})
    cs = make_chunks(4)
    plan = [1, 2, TEXT, 3]
    fast, slow = 0.2, 0.02
    futures = np.array([[1 / (fast * 1e9)] * 3, [1 / (slow * 1e9)] * 3])
    st = PipelineState(time_left_s=1.0, cpu_busy_s=0.05)

    def oracle(tail):
        link, cpu = 0.0, 0.05
        for j, (c, o) in enumerate(zip(cs, plan)):
            if o == TEXT:
                cpu += recompute_s(c)
                continue
            link += LATENCY_S + c.sizes[o] * 8 / ((G if j == 0 else tail) * 1e9)
            cpu = max(cpu, link) + DECODE_S
        return cpu

    lo, hi = oracle(fast), oracle(slow)
    assert lo < hi
    got = [finish_quantile(cs, plan, 1 / (G * 1e9), futures, costs, st, q) for q in (0.0, 0.5, 1.0)]
    assert got == pytest.approx([lo, (lo + hi) / 2, hi], abs=1e-12)
