"""The planner's small functions, each against values worked out by hand or by the pipeline timer
of :mod:`stream.plan_oracle` (which uses only the cost model): the recency boost and the fetch
order at their boundaries, the lift among allowed levels, simulate with a rate per chunk, the
greedy tail's ties and allowed levels, tail_at for chunks that lack the level, finish_quantile
with a different rate per later chunk, the rule's exact threshold, the cold start's tie, and the
fastest policy's option filter and step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachegen.stream import decide
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.planner import (
    PipelineState,
    PlanChunk,
    _at,
    _prices,
    _step,
    cheapest_tail,
    choose_rule,
    chunk_costs,
    fetch_order,
    finish_quantile,
    lift,
    simulate,
    tail_at,
    useful_options,
    with_recency_boost,
)
from stream.plan_oracle import COSTS, EXACT, SIZES, TOKENS, G, end, make_chunks, run, step, undominated


def kw(**k):
    d = dict(time_left_s=1.0, cpu_busy_s=0.0, est_gbps=G, last_gbps=G, tail_gbps=G, known=True)
    d.update(k)
    return d


# -- the recency boost, the fetch order, the lift ------------------------------------------------


def test_the_boost_keeps_the_chunk_and_leaves_an_earlier_mark():
    cs = make_chunks(3)
    b = with_recency_boost(cs, 2)
    assert b[-1] == PlanChunk(2, 2 * TOKENS, TOKENS, 0, SIZES, 2)  # the same chunk, marked
    assert b[:2] == cs[:2] and cs[-1].boost == 0  # the input is not changed
    # a boost of 0 (or less) marks nothing: a chunk marked before keeps its mark
    assert with_recency_boost(b, 0)[-1].boost == 2
    assert with_recency_boost(b, -1)[-1].boost == 2


def test_the_fetch_order_at_its_boundaries():
    cs = make_chunks(3)
    one = [*cs[:2], replace(cs[2], boost=1)]
    assert fetch_order(one, adaptive=True, cold=False) == ([2, 0, 1], 2)  # one level better is a boost
    # three chunks are enough to probe first: chunk 0 takes the probe, the boosted one comes second
    assert fetch_order(one, adaptive=True, cold=True) == ([0, 2, 1], 2)
    assert fetch_order(with_recency_boost(make_chunks(4), 2), adaptive=True, cold=True) == ([0, 3, 1, 2], 3)


def test_lift_leaves_a_chunk_without_a_positive_boost_alone():
    c = replace(make_chunks(1)[0], boost=-1)
    assert [lift(c, lv) for lv in (1, 2, 3)] == [1, 2, 3]  # a negative boost does not make it worse
    b = replace(make_chunks(1)[0], boost=1)
    assert lift(b, TEXT) == TEXT and lift(b, 7) == 7  # text, and a level not stored, stay as they are


# -- costs, simulate ---------------------------------------------------------------------------


def test_text_costs_no_network_time():
    c = make_chunks(2)[1]
    assert chunk_costs(c, TEXT, G, COSTS) == (0.0, COSTS.recompute_s(c.start, c.num_tokens))
    assert chunk_costs(c, 2, G, COSTS) == (COSTS.fetch_s(SIZES[2], G), COSTS.decode_s(2, 0))


def test_simulate_takes_the_rate_of_each_chunk_by_its_index():
    cs = make_chunks(3, first=5)  # indices 5, 6, 7: the rate function is keyed by index, not position
    rates = {5: 0.1, 6: 0.05, 7: 0.4}
    plan = [1, 3, 2]
    got = simulate(cs, plan, rates.__getitem__, COSTS)
    assert got == run(cs, plan, [0.1, 0.05, 0.4])[1]
    # by hand: 20 ms, then 10 ms more (30 ms), then 2.5 ms more (32.5 ms), each decode 2 ms after
    assert got == pytest.approx(0.0345, abs=1e-12)
    assert got != simulate(cs, plan, 0.1, COSTS)
    st = PipelineState(time_left_s=0.0, cpu_busy_s=0.5, net_busy_s=0.01)
    assert simulate(cs, plan, 0.1, COSTS, st) == run(cs, plan, 0.1, net=0.01, cpu=0.5)[1]


# -- the greedy tail and tail_at ---------------------------------------------------------------


def test_the_greedy_tail_breaks_ties_to_the_better_level_then_the_freer_link():
    twin = PlanChunk(0, 0, TOKENS, 0, {1: 1000, 2: 1000})  # two levels that cost the same
    net, cpu, picks = cheapest_tail([twin], G, COSTS, 0.0, 0.0)
    assert picks == [1] and (net, cpu) == step(0.0, 0.0, twin, 1, G, COSTS)
    # compute-bound (1 s of work queued): both levels end at 1.002 s; level 1 leaves the link free sooner
    odd = PlanChunk(0, 0, TOKENS, 0, {1: 100, 2: 1000})
    net, cpu, picks = cheapest_tail([odd], G, COSTS, 0.0, 1.0)
    assert picks == [1] and net == COSTS.fetch_s(100, G) and cpu == pytest.approx(1.002, abs=1e-12)


def test_the_greedy_tail_keeps_to_the_allowed_levels():
    cs = make_chunks(2)
    net, cpu, picks = cheapest_tail(cs, G, COSTS, 0.0, 0.0, allowed=(1,))
    assert picks == [1, 1] and (net, cpu) == run(cs, [1, 1], G)
    assert cheapest_tail(cs, G, COSTS, 0.0, 0.0)[2] == [3, 3]  # the smallest, without the restriction


def test_tail_at_gives_a_chunk_without_the_level_its_fastest_allowed_option():
    lacks = PlanChunk(1, TOKENS, TOKENS, 0, {1: 250_000, 3: 62_500})  # no level 2
    # the link is busy for 10 ms more: level 1 ends at 10 + 20 + 2 ms (level 3, not allowed: 17 ms)
    got = tail_at([lacks], 2, G, COSTS, 0.01, 0.0, allowed=(1,))
    assert got == run([lacks], [1], G, net=0.01)[1] == pytest.approx(0.032, abs=1e-12)
    assert tail_at([lacks], 2, G, COSTS, 0.01, 0.0) == pytest.approx(0.017, abs=1e-12)
    # a chunk that has it takes it; text everywhere is text everywhere
    cs = make_chunks(3)
    assert tail_at(cs, 2, G, COSTS, 0.0, 0.0) == end(cs, [2, 2, 2], G)
    assert tail_at(cs, TEXT, G, COSTS, 0.0, 0.0) == end(cs, [TEXT] * 3, G)


def test_tail_at_lifts_a_boosted_chunk_among_the_allowed_levels():
    b = replace(make_chunks(1)[0], boost=1)
    # level 3 lifted by one among (1, 3) is level 1: 20 + 2 ms (among all levels it would be 2: 12 ms)
    assert tail_at([b], 3, G, COSTS, 0.0, 0.0, allowed=(1, 3)) == pytest.approx(0.022, abs=1e-12)
    assert tail_at([b], 3, G, COSTS, 0.0, 0.0) == pytest.approx(0.012, abs=1e-12)


# -- finish_quantile ---------------------------------------------------------------------------


def test_finish_quantile_prices_each_later_chunk_at_its_own_column():
    cs = make_chunks(4)
    plan = [1, 2, 3, 1]
    rates = [0.2, 0.05, 0.4]  # of chunks 1, 2 and 3 in the one future
    futures = np.array([[1 / (g * 1e9) for g in rates]])
    st = PipelineState(time_left_s=1.0)
    got = finish_quantile(cs, plan, 1 / (G * 1e9), futures, COSTS, st, 0.5)
    assert got == pytest.approx(run(cs, plan, [G, *rates])[1], abs=1e-12)
    # by hand: fetches end at 20, 25, 35 and 40 ms; the last decode 2 ms later
    assert got == pytest.approx(0.042, abs=1e-12)


# -- the rule and the cold start ---------------------------------------------------------------


def test_the_rule_takes_a_level_whose_fetch_is_exactly_the_share():
    c = make_chunks(1)[0]
    share = COSTS.fetch_s(SIZES[3], G)  # 5 ms: levels 1 and 2 take longer
    assert choose_rule(c, share, G, COSTS) == 3
    assert choose_rule(c, share * (1 - 1e-9), G, COSTS) == TEXT
    assert choose_rule(c, 1.0, G, COSTS, allowed=(2, 3)) == 2  # the best allowed level
    assert choose_rule(c, 1.0, G, COSTS, allowed=(5,)) == TEXT


def test_a_cold_start_takes_the_probe_when_recomputing_is_no_faster():
    """A fetch of 1.0 s and a decode of 0.5 s against a recompute of 1.5 s: a tie keeps the probe
    (whose fetch measures the link); a recompute a little faster takes text."""
    c = PlanChunk(0, 0, 1, 0, {1: 125_000_000})
    args = dict(time_left_s=10.0, cpu_busy_s=0.0, est_gbps=1.0, last_gbps=1.0, tail_gbps=1.0, known=False)
    assert decide("adaptive", [c], EXACT, **args) == 1
    assert decide("fastest", [c], EXACT, **args) == 1
    faster = CostModel(**{**EXACT.__dict__, "recompute_fixed_s": 0.25})
    assert decide("adaptive", [c], faster, **args) == TEXT


@pytest.mark.parametrize("policy", ["adaptive", "rule", "fastest"])
def test_a_cold_start_probes_with_the_smallest_allowed_level(policy):
    cs = make_chunks(3)
    assert decide(policy, cs, COSTS, share_s=1.0, **kw(known=False)) == 3
    assert decide(policy, cs, COSTS, share_s=1.0, allowed=(1, 2), **kw(known=False)) == 2
    assert decide(policy, cs, COSTS, share_s=1.0, allowed=(1,), **kw(known=False, cpu_busy_s=0.3)) == 1


def test_the_rule_after_text_probes_with_the_smallest_allowed_level_and_then_keeps_to_them():
    cs = make_chunks(3)
    assert decide("rule", cs, COSTS, share_s=1.0, prev=TEXT, allowed=(1, 2), **kw()) == 2
    assert decide("rule", cs, COSTS, share_s=1.0, prev=1, allowed=(2, 3), **kw()) == 2
    assert decide("rule", cs, COSTS, share_s=0.011, prev=1, **kw()) == 2  # 10 ms fits, 20 ms does not


# -- the fastest policy's options and step -----------------------------------------------------

MV = 1_000_000  # values per chunk: a level's decode is its seconds per million values
LADDER = CostModel(
    decode_s_per_mvalue={0: 0.001, 1: 0.004, 2: 0.006, 3: 0.004, 4: 0.001},
    decode_fixed_s=0.0,
    recompute_fixed_s=0.0,
    recompute_s_per_token=1e-3,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)


def test_useful_options_drop_exactly_the_levels_beaten_on_both_costs():
    # 0: big, fast to decode; 1: small, slow; 2: as small as 1, slower; 3: as slow as 1, bigger;
    # 4: the same costs as 0 (neither beats the other)
    c = PlanChunk(0, 0, TOKENS, MV, {0: 8000, 1: 2000, 2: 2000, 3: 3000, 4: 8000})
    assert useful_options(c, LADDER) == [0, 1, 4, TEXT] == undominated(c, LADDER)
    assert useful_options(c, LADDER, allowed=(1, 2, 3)) == [1, TEXT]  # 1 beats 2 and 3
    assert useful_options(c, LADDER, allowed=(2, 3)) == [2, 3, TEXT]  # neither beats the other
    assert useful_options(PlanChunk(0, 0, TOKENS, MV, {}), LADDER) == [TEXT]


def test_the_soonest_option_ends_the_compute_first_then_frees_the_link_first():
    def _soonest(net, cpu, chunk, choices, gbps, costs, prev):  # at the prices the chunk has there
        from cachegen.stream.planner import _soonest as soonest

        return soonest(net, cpu, prev, choices, _prices(chunk, choices, gbps, costs))

    c = PlanChunk(0, 0, 1, 0, {1: 125_000_000})
    # fetching (1.0 s + 0.5 s) and recomputing (1.5 s) tie on the compute stage: text leaves the link idle
    assert _soonest(0.0, 0.0, c, [1, TEXT], 1.0, EXACT, None) == (0.0, 1.5, TEXT)
    # recomputing in 2.0 s: the fetch ends the chunk sooner although it holds the link
    slow = CostModel(**{**EXACT.__dict__, "recompute_fixed_s": 1.0})
    assert _soonest(0.0, 0.0, c, [1, TEXT], 1.0, slow, None) == (1.0, 1.5, 1)
    assert _soonest(0.0, 0.0, c, [TEXT, 1], 1.0, slow, None) == (1.0, 1.5, 1)
    # a tie on the compute stage goes to the option that frees the link first, in either order
    assert _soonest(0.0, 0.0, c, [TEXT, 1], 1.0, EXACT, None) == (0.0, 1.5, TEXT)
    # a tie on both: the earlier option
    twin = PlanChunk(0, 0, 1, 1_000_000, {1: 125_000_000, 2: 125_000_000})
    same = CostModel(**{**EXACT.__dict__, "decode_s_per_mvalue": {1: 0.5, 2: 0.5}})
    assert _soonest(0.0, 0.0, twin, [1, 2], 1.0, same, None)[2] == 1
    assert _soonest(0.0, 0.0, twin, [2, 1], 1.0, same, None)[2] == 2
    # from a busy pipeline, at another rate: the fetch waits for the link and the compute stage
    assert _soonest(0.5, 2.0, c, [1], 2.0, slow, 1) == (*step(0.5, 2.0, c, 1, 2.0, slow, 1), 1) == (1.0, 2.5, 1)


def test_a_step_at_a_precomputed_price_is_the_step():
    """choose_fastest steps at prices computed once per decision: the same floats as _step, for
    text and levels, batched or not, from idle and busy pipelines, at the batched price only
    after a chunk of the same level that the compute stage is still busy with."""
    rng = np.random.default_rng(7)
    quiet = replace(COSTS, decode_batched_s_per_mvalue={1: 0.004, 4: 0.009})
    stealing = replace(quiet, fetch_cpu_s_per_mb=0.0015)
    seen = {"batched": 0, "text": 0, "idle": 0, "stolen": 0}
    for i in range(300):
        costs = stealing if i % 2 else quiet
        ch = PlanChunk(
            3,
            int(rng.integers(0, 4096)),
            256,
            int(rng.integers(1, 4_000_000)),
            {1: int(rng.integers(1, 9e6)), 4: int(rng.integers(1, 9e6))},
        )
        net, cpu = float(rng.uniform(0, 0.2)), float(rng.uniform(0, 0.2))
        prev = rng.choice(np.array([None, 1, 4, TEXT], dtype=object))
        gbps = float(rng.choice([0.1, 1.0, 10.0]))
        prices = _prices(ch, [1, 4, TEXT], gbps, costs)
        for c in (1, 4, TEXT):
            assert _at(net, cpu, prev, c, prices[c]) == _step(net, cpu, ch, c, gbps, costs, prev)
            seen["batched"] += c != TEXT and prev == c and cpu > net + prices[c][0]
            seen["idle"] += c != TEXT and cpu <= net + prices[c][0]
            seen["stolen"] += c != TEXT and cpu > net and costs is stealing
        seen["text"] += 1
    assert all(v > 20 for v in seen.values()), seen


def test_a_chunk_that_arrives_just_as_the_compute_stage_frees_is_not_batched():
    """The batched price only while the compute stage is still busy: at exactly the chunk's
    arrival it is free, so the chunk is decoded alone (as _step does)."""
    from cachegen.stream.planner import _soonest

    price = (0.25, 1.0, 0.5, 0.0)  # fetch, decode alone, batched, fetch CPU: binary fractions, exact sums
    assert _at(0.25, 0.5, 1, 1, price) == (0.5, 1.5)
    assert _at(0.25, 0.625, 1, 1, price) == (0.5, 1.125)  # still busy: batched
    assert _soonest(0.25, 0.5, 1, [1], {1: price}) == (0.5, 1.5, 1)
    assert _soonest(0.25, 0.625, 1, [1], {1: price}) == (0.5, 1.125, 1)


def test_a_fetch_that_begins_while_the_compute_stage_is_busy_adds_its_cpu_time_to_it():
    """The fetch's CPU time joins the compute stage's work only when that stage is busy as the
    fetch begins; it can then keep the stage busy past the chunk's arrival (a batched decode)."""
    from cachegen.stream.planner import _soonest

    price = (0.25, 1.0, 0.5, 0.125)
    assert _at(0.25, 0.5, 1, 1, price) == (0.5, 1.125)  # 0.5 + 0.125 > 0.5: busy at arrival, batched
    assert _at(0.25, 0.375, 1, 1, price) == (0.5, 1.5)  # 0.375 + 0.125 = arrival: free, alone
    assert _at(0.25, 0.25, 1, 1, price) == (0.5, 1.5)  # free as the fetch begins: nothing taken
    assert _at(0.25, 0.875, 4, 1, price) == (0.5, 2.0)  # busy, another level: 0.875 + 0.125 + 1.0
    assert _soonest(0.25, 0.5, 1, [1], {1: price}) == (0.5, 1.125, 1)
    assert _soonest(0.25, 0.375, 1, [1], {1: price}) == (0.5, 1.5, 1)
    assert _soonest(0.25, 0.875, 4, [1], {1: price}) == (0.5, 2.0, 1)
    assert _at(0.25, 2.0, 1, TEXT, price) == (0.25, 3.0)  # a recompute fetches nothing
    # a fetch shorter than its CPU time: taken only from a stage busy as it begins, not one that
    # frees just then (it would then be busy at the chunk's arrival, and batch it)
    short = (0.125, 1.0, 0.5, 0.25)
    assert _at(0.25, 0.25, 1, 1, short) == (0.375, 1.375)
    assert _soonest(0.25, 0.25, 1, [1], {1: short}) == (0.375, 1.375, 1)
    assert _at(0.25, 0.375, 1, 1, short) == (0.375, 1.125)  # 0.625 at arrival: batched
    assert _soonest(0.25, 0.375, 1, [1], {1: short}) == (0.375, 1.125, 1)
