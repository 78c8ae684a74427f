"""The adaptive policy's paths one by one, with plans and times worked out by hand and checked by
the pipeline timer of :mod:`stream.plan_oracle`: the second step (this chunk as good as possible,
the rest as fast as possible) and its text rule, ties and budgets met exactly, the allowed levels
everywhere, and risk planning (futures of the link's rate), given directly and built by decide()
from the past fetches (the minimum history, the quantile, the seed, a slowdown beyond the older
history)."""

from __future__ import annotations

import numpy as np
import pytest

from cachegen.stream import decide
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.planner import (
    PipelineState,
    PlanChunk,
    cheapest_tail,
    choose_adaptive,
    chunk_costs,
    finish_quantile,
    tail_at,
)
from stream.plan_oracle import COSTS, EXACT, SIZES, TOKENS, G, end, make_chunks

EPS = 1e-12  # a budget this far (relative) above or below a plan's end: far above float round-off


def spb(gbps: float) -> float:
    """Seconds per bit at ``gbps``."""
    return 1.0 / (gbps * 1e9)


def after(c: PlanChunk, o, gbps: float, net: float = 0.0, cpu: float = 0.0) -> tuple[float, float]:
    """(link free, compute free) after one chunk, as the loader would run it."""
    n, d = chunk_costs(c, o, gbps, COSTS)
    if o == TEXT:
        return net, cpu + d
    net = net + n
    return net, max(cpu, net) + d


def test_an_empty_load_is_refused():
    with pytest.raises(ValueError, match=r"^no chunk to plan$"):
        choose_adaptive([], G, COSTS, PipelineState(1.0))


# -- step 1: an even plan ----------------------------------------------------------------------


def test_an_even_plan_that_ends_exactly_at_the_deadline_fits():
    cs = make_chunks(3)
    budget = tail_at(cs[1:], 1, G, COSTS, *after(cs[0], 1, G))  # level 1 for every chunk
    assert budget == end(cs, [1, 1, 1], G) and budget == pytest.approx(0.062, abs=1e-12)
    p = choose_adaptive(cs, G, COSTS, PipelineState(budget))
    assert (p.choice, p.total_s, p.fits) == (1, budget, True)


def test_the_even_plan_keeps_to_the_allowed_levels():
    cs = make_chunks(3)
    assert choose_adaptive(cs, G, COSTS, PipelineState(10.0), allowed=(2, 3)).choice == 2
    assert choose_adaptive(cs, G, COSTS, PipelineState(10.0), allowed=(9,)).choice == TEXT  # none stored
    boosted = [PlanChunk(0, 0, TOKENS, 0, SIZES, boost=1), *cs[1:]]
    # level 2 lifted by one among (2, 3) stays 2 (level 1 is not allowed)
    assert choose_adaptive(boosted, G, COSTS, PipelineState(10.0), allowed=(2, 3)).choice == 2


def test_a_chunk_without_the_level_is_priced_at_its_fastest_allowed_option():
    """Chunk 1 has no level 3; among the allowed (1, 3) its fastest is level 1. Level 3 for chunk 0
    then ends at 5 + 20 + 2 = 27 ms (with level 2 for chunk 1 it would be 17 ms): with 20 ms nothing
    fits, and the fastest plan is level 3, predicted to end at 27 ms."""
    cs = [make_chunks(1)[0], PlanChunk(1, TOKENS, TOKENS, 0, {1: 250_000, 2: 125_000})]
    p = choose_adaptive(cs, G, COSTS, PipelineState(0.02), allowed=(1, 3))
    assert (p.choice, p.fits) == (3, False)
    assert p.total_s == pytest.approx(0.027, abs=1e-12) == end(cs, [3, 1], G)


def test_a_tie_between_text_and_the_level_goes_to_text():
    """Text is exact: when it ends the chunk exactly when the fetch would (1.5 s each), it is taken."""
    c = PlanChunk(0, 0, 1, 0, {1: 125_000_000})
    p = choose_adaptive([c], 1.0, EXACT, PipelineState(2.0))
    assert (p.choice, p.finish_s, p.total_s, p.fits) == (TEXT, 1.5, 1.5, True)


# -- step 2: this chunk as good as possible, the rest as fast as possible -------------------------

# 100-token chunks (recompute: 10 + 100 ms). This chunk's fetch at 2 Mbit/s: 200, 100 or 50 ms;
# the later ones' at 0.1 Mbit/s: 4, 2 or 1 s, so every even plan takes over a second and the
# fastest tail recomputes both later chunks (110 ms each). With the head at level 1, 2, 3 or text
# the load ends at 422, 322, 272 or 330 ms, and the head's compute at 202, 102, 52 or 110 ms.
SHORT = 100
SMALL = {1: 50_000, 2: 25_000, 3: 12_500}
HEAD_GBPS, TAIL_GBPS = 0.002, 0.0001


def short_chunks():
    return [PlanChunk(i, i * SHORT, SHORT, 0, dict(SMALL)) for i in range(3)]


@pytest.mark.parametrize(
    ("budget", "want"),
    [
        (0.5, TEXT),  # level 1 fits; text fits too and ends the chunk sooner (110 < 202 ms)
        (0.35, 2),  # level 2 is the best that fits; text fits but ends the chunk later (110 > 102 ms)
        (0.3, 3),  # only level 3 fits (text needs 330 ms)
        (0.25, 3),  # nothing fits: the soonest end (272 ms)
    ],
)
def test_the_best_level_with_the_fastest_tail_and_text_when_it_is_sooner(budget, want):
    cs = short_chunks()
    assert all(end(cs, [lv] * 3, HEAD_GBPS, TAIL_GBPS) > 1.0 for lv in SMALL)
    for lv, total in ((1, 0.422), (2, 0.322), (3, 0.272)):
        assert end(cs, [lv, TEXT, TEXT], HEAD_GBPS, TAIL_GBPS) == pytest.approx(total, abs=1e-12)
    assert end(cs, [TEXT] * 3, HEAD_GBPS, TAIL_GBPS) == pytest.approx(0.33, abs=1e-12)
    p = choose_adaptive(cs, HEAD_GBPS, COSTS, PipelineState(budget), tail_gbps=TAIL_GBPS)
    assert p.choice == want and p.fits == (budget >= 0.3)


def test_a_plan_with_the_fastest_tail_that_ends_exactly_at_the_deadline_fits():
    cs = short_chunks()
    budget = cheapest_tail(cs[1:], TAIL_GBPS, COSTS, *after(cs[0], 2, HEAD_GBPS))[1]
    assert budget == pytest.approx(0.322, abs=1e-12)
    p = choose_adaptive(cs, HEAD_GBPS, COSTS, PipelineState(budget), tail_gbps=TAIL_GBPS)
    assert (p.choice, p.total_s, p.fits) == (2, budget, True)


# Binary fractions, so that ends tie exactly: fetches at 1 Gbit/s of 500, 250 and 125 ms (at
# 0.125 Gbit/s 4, 2 and 1 s), decodes of 125 ms, a recompute of 125 ms + 62.5 ms a token. Chunk 1
# (64 tokens) is cheapest fetched at level 3, chunk 2 (2 tokens) recomputed. With this chunk at
# level 1, 2, 3 the load ends at 1.875, 1.625, 1.5 s; with text (6 or 8 tokens: 0.5 or 0.625 s)
# at 1.375 s.
DYADIC = CostModel(
    decode_s_per_mvalue={},
    decode_s_per_mvalue_default=0.0,
    decode_fixed_s=0.125,
    recompute_fixed_s=0.125,
    recompute_s_per_token=0.0625,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)
BIG = {1: 62_500_000, 2: 31_250_000, 3: 15_625_000}


def dyadic_chunks(head_tokens: int) -> list[PlanChunk]:
    return [
        PlanChunk(0, 0, head_tokens, 0, dict(BIG)),
        PlanChunk(1, head_tokens, 64, 0, dict(BIG)),
        PlanChunk(2, head_tokens + 64, 2, 0, dict(BIG)),
    ]


@pytest.mark.parametrize(
    ("head_tokens", "budget", "want"),
    [
        (6, 1.55, 3),  # only level 3 fits; text fits too (1.375 s) but ends this chunk later (0.5 > 0.25 s)
        (6, 1.7, 2),  # level 2 fits; text ends this chunk later (0.5 > 0.375 s)
        (8, 1.9, TEXT),  # level 1 fits; text (8 tokens) ends this chunk as soon as level 1 (0.625 s): text
        (8, 1.7, 2),
    ],
)
def test_the_fastest_tail_step_with_exact_times(head_tokens, budget, want):
    cs = dyadic_chunks(head_tokens)
    for lv, total in ((1, 1.875), (2, 1.625), (3, 1.5)):
        assert end(cs, [lv, 3, TEXT], 1.0, 0.125, DYADIC) == total
        assert end(cs, [lv] * 3, 1.0, 0.125, DYADIC) > 2.0  # no even plan fits
    assert end(cs, [TEXT, 3, TEXT], 1.0, 0.125, DYADIC) == 1.375  # chunk 1's fetch (1 s) hides the recompute
    p = choose_adaptive(cs, 1.0, DYADIC, PipelineState(budget), tail_gbps=0.125)
    assert p.choice == want and p.fits, p


# -- risk planning: futures given --------------------------------------------------------------

# Chunk 1 has no level 2 (its fastest option then: level 3). Two futures after this chunk's fetch
# at 0.1 Gbit/s: the later fetches at 0.2 Gbit/s, or at 0.05. With the 1.0 quantile an even plan
# fits when it fits the slow future: levels 1, 2 (chunk 1 at 3) and 3 end at 102, 42 and 27 ms.
FAST, SLOW = 0.2, 0.05


def risk_chunks():
    cs = make_chunks(3)
    return [cs[0], PlanChunk(1, TOKENS, TOKENS, 0, {1: 250_000, 3: 62_500}), cs[2]]


def two_futures(n_later: int) -> np.ndarray:
    return np.array([[spb(FAST)] * n_later, [spb(SLOW)] * n_later])


def risk_ends(cs):
    plans = {1: [1, 1, 1], 2: [2, 3, 2], 3: [3, 3, 3]}
    return {lv: max(end(cs, plan, G, g) for g in (FAST, SLOW)) for lv, plan in plans.items()}


def test_the_risk_plans_by_hand():
    assert risk_ends(risk_chunks()) == pytest.approx({1: 0.102, 2: 0.042, 3: 0.027}, abs=1e-12)


@pytest.mark.parametrize(
    ("level", "side", "want"),
    [
        (1, +1, 1),
        (1, -1, 2),
        (2, +1, 2),
        (2, -1, 3),
        (3, +1, 3),
        # no even plan fits the slow future: level 2 for this chunk, the rest at the fastest option
        # at the tail rate (0.2 Gbit/s: 17 ms; level 1 would end at 27 ms)
        (3, -1, 2),
    ],
)
def test_risk_planning_fits_the_even_plan_to_the_slow_future(level, side, want):
    cs = risk_chunks()
    budget = risk_ends(cs)[level] * (1 + side * EPS)
    p = choose_adaptive(cs, G, COSTS, PipelineState(budget), tail_gbps=FAST, futures=two_futures(2), risk_quantile=1.0)
    assert p.choice == want, (level, side, p)


def test_a_risk_plan_that_ends_exactly_at_the_deadline_fits():
    cs = risk_chunks()
    st = PipelineState(1.0)
    budget = finish_quantile(cs, [2, 3, 2], spb(G), two_futures(2), COSTS, st, 1.0)
    assert budget == pytest.approx(0.042, abs=1e-12)
    p = choose_adaptive(cs, G, COSTS, PipelineState(budget), tail_gbps=FAST, futures=two_futures(2), risk_quantile=1.0)
    assert p.choice == 2


def test_risk_planning_with_one_or_no_allowed_level():
    cs = make_chunks(3)
    f = two_futures(2)
    assert choose_adaptive(cs, G, COSTS, PipelineState(1.0), allowed=(2,), futures=f).choice == 2
    # nothing allowed is stored: text (3 x 266 ms fits 1 s)
    assert choose_adaptive(cs, G, COSTS, PipelineState(1.0), allowed=(9,), futures=f).choice == TEXT


def test_risk_planning_lifts_boosted_chunks_and_prices_missing_levels_among_the_allowed():
    """Levels 1-4 (32, 16, 8, 4 ms at 0.1 Gbit/s; twice that at 0.05), allowed (1, 2, 4); chunks 0
    and 2 boosted by one level, chunk 1 without level 4. The even plan at level 4 is then level 2
    for every chunk (chunk 1: its fastest allowed option): it ends at 82 ms. With 90 ms it fits;
    with 78 ms no even plan fits, and level 1 with the fastest tail (2, then 4) ends at 74 ms."""
    four = {1: 400_000, 2: 200_000, 3: 100_000, 4: 50_000}
    cs = [
        PlanChunk(0, 0, TOKENS, 0, four, boost=1),
        PlanChunk(1, TOKENS, TOKENS, 0, {1: 400_000, 2: 200_000, 3: 100_000}),
        PlanChunk(2, 2 * TOKENS, TOKENS, 0, four, boost=1),
    ]
    futures = np.full((2, 2), spb(SLOW))
    assert end(cs, [2, 2, 2], G, SLOW) == pytest.approx(0.082, abs=1e-12)
    assert end(cs, [1, 2, 4], G, SLOW) == pytest.approx(0.074, abs=1e-12)
    kw = dict(allowed=(1, 2, 4), tail_gbps=SLOW, futures=futures, risk_quantile=1.0)
    assert choose_adaptive(cs, G, COSTS, PipelineState(0.09), **kw).choice == 2
    assert choose_adaptive(cs, G, COSTS, PipelineState(0.078), **kw).choice == 1


def test_risk_planning_takes_text_only_when_its_plan_fits_at_the_tail_rate():
    """This chunk's fetch is slow (0.005 Gbit/s: 400 ms at level 1) and the futures fast (1 Gbit/s),
    so level 1 for every chunk fits 0.5 s (406 ms); text ends this chunk sooner (266 ms), but its
    plan at the tail rate (0.005 Gbit/s) ends at 802 ms: level 1 then, and text from 802 ms on."""
    cs = make_chunks(3)
    futures = np.full((2, 2), spb(1.0))
    kw = dict(tail_gbps=0.005, futures=futures, risk_quantile=0.5)
    text_plan = tail_at(cs[1:], 1, 0.005, COSTS, *after(cs[0], TEXT, 0.005))
    assert text_plan == pytest.approx(0.802, abs=1e-12)
    assert choose_adaptive(cs, 0.005, COSTS, PipelineState(0.5), **kw).choice == 1
    assert choose_adaptive(cs, 0.005, COSTS, PipelineState(text_plan), **kw).choice == TEXT


def test_the_text_plan_prices_a_missing_level_among_the_allowed():
    """As above, with chunk 1 stored at levels 2 and 3 only and (1, 2) allowed: after text, chunk 1
    at level 2 (200 ms at 0.005 Gbit/s; level 3 would take 100 ms) and chunk 2 at level 1 end at
    602 ms, later than 0.55 s: level 1 for this chunk (its risk plan ends at 406 ms)."""
    cs = make_chunks(3)
    cs[1] = PlanChunk(1, TOKENS, TOKENS, 0, {2: 125_000, 3: 62_500})
    assert tail_at(cs[1:], 1, 0.005, COSTS, *after(cs[0], TEXT, 0.005), allowed=(1, 2)) == pytest.approx(0.602)
    assert tail_at(cs[1:], 1, 0.005, COSTS, *after(cs[0], TEXT, 0.005)) == pytest.approx(0.502)
    kw = dict(allowed=(1, 2), tail_gbps=0.005, futures=np.full((2, 2), spb(1.0)), risk_quantile=0.5)
    assert choose_adaptive(cs, 0.005, COSTS, PipelineState(0.55), **kw).choice == 1
    assert choose_adaptive(cs, 0.005, COSTS, PipelineState(0.65), **kw).choice == TEXT


# -- risk planning: decide() builds the futures from the past fetches ----------------------------


def even_choice(cs, budget, head_gbps, tail_gbps):
    """The best level whose even plan ends in time."""
    fits = [lv for lv in sorted(cs[0].sizes) if end(cs, [lv] * len(cs), head_gbps, tail_gbps) <= budget]
    assert fits, budget
    return fits[0]


def dkw(**k):
    d = dict(cpu_busy_s=0.0, est_gbps=G, last_gbps=G, tail_gbps=1.0, known=True)
    d.update(k)
    return d


def thresholds(cs, head_gbps, tail_gbps):
    out = []
    for lv in sorted(cs[0].sizes):
        t = end(cs, [lv] * len(cs), head_gbps, tail_gbps)
        out += [t * (1 + EPS), t * (1 - EPS)]
    return out[:-1]  # not below the fastest even plan


@pytest.mark.parametrize("n", [2, 3])
def test_four_past_fetches_are_enough_to_plan_at_their_rate(n):
    """A steady history at 0.05 Gbit/s, the tail estimate at 1 Gbit/s: with MIN_HISTORY (4) samples
    the even plan is fitted to the history's rate, with 3 to the tail estimate."""
    cs = make_chunks(n)
    for budget in thresholds(cs, G, SLOW):
        want = even_choice(cs, budget, G, SLOW)
        got = decide("adaptive", cs, COSTS, time_left_s=budget, history_s_per_bit=[spb(SLOW)] * 4, **dkw())
        assert got == want, (n, budget)
        few = decide("adaptive", cs, COSTS, time_left_s=budget, history_s_per_bit=[spb(SLOW)] * 3, **dkw())
        assert few == even_choice(cs, budget, G, 1.0), (n, budget)
    # the two differ (n = 2: level 1 ends at 62 ms at the slow rate, at 24 ms at 1 Gbit/s)
    assert any(even_choice(cs, b, G, SLOW) != even_choice(cs, b, G, 1.0) for b in thresholds(cs, G, SLOW))


@pytest.mark.parametrize(("q", "rate"), [(0.0, FAST), (1.0, SLOW)])
def test_the_quantile_picks_the_future(q, rate):
    """Half the past fetches at 0.2 Gbit/s, half at 0.05: the 0 quantile plans at the fast rate,
    the 1 quantile at the slow one."""
    cs = make_chunks(2)
    history = [spb(FAST), spb(SLOW)] * 2
    for budget in thresholds(cs, G, rate):
        got = decide("adaptive", cs, COSTS, time_left_s=budget, history_s_per_bit=history, risk_quantile=q, **dkw())
        assert got == even_choice(cs, budget, G, rate), (q, budget)


def test_the_same_inputs_give_the_same_choice():
    """At the median, with half the past fetches fast and half slow, level 1 fits only if fewer
    than half of the resampled futures are slow: the futures are seeded (by the chunk index)."""
    cs = make_chunks(2)
    history = [spb(FAST), spb(SLOW)] * 2
    budget = (end(cs, [1, 1], G, FAST) + end(cs, [1, 1], G, SLOW)) / 2
    args = dict(time_left_s=budget, history_s_per_bit=history, risk_quantile=0.5, **dkw())
    got = {decide("adaptive", cs, COSTS, **args) for _ in range(30)}
    assert len(got) == 1 and got <= {1, 2}, got


A, B = spb(FAST), spb(SLOW)


def test_a_slowdown_beyond_the_older_history_shifts_every_future_to_the_estimate():
    """Three fast fetches, two slow ones, three fast: the slow pair is in the estimator's window
    (the last 5) and slower than anything before it, so every future is scaled by the estimate's
    seconds per bit over the history's mean (1e-8 / 8.75e-9 = 8/7); the 1 quantile then plans at
    the slow rate times 8/7."""
    cs = make_chunks(2)
    history = [A, A, A, B, B, A, A, A]
    scale = spb(G) / np.mean(history)
    assert scale == pytest.approx(8 / 7, rel=1e-12)
    rate = 1.0 / (B * scale * 1e9)
    for budget in thresholds(cs, G, rate):
        got = decide("adaptive", cs, COSTS, time_left_s=budget, history_s_per_bit=history, risk_quantile=1.0, **dkw())
        assert got == even_choice(cs, budget, G, rate), budget
    # without the scaling the slow future alone would already take level 2 at its threshold
    t2 = end(cs, [2, 2], G, rate)
    assert even_choice(cs, t2 * (1 - EPS), G, rate) == 3 and even_choice(cs, t2 * (1 - EPS), G, SLOW) == 2


def test_a_steady_history_is_not_scaled_to_a_slower_estimate():
    """Eight fetches at 0.2 Gbit/s and an estimate of 0.1: no sample beyond the older ones, so the
    futures stay at 0.2 Gbit/s."""
    cs = make_chunks(2)
    for budget in thresholds(cs, G, FAST):
        got = decide("adaptive", cs, COSTS, time_left_s=budget, history_s_per_bit=[A] * 8, risk_quantile=0.5, **dkw())
        assert got == even_choice(cs, budget, G, FAST), budget


def test_a_slowdown_with_a_faster_estimate_leaves_the_futures_alone():
    """The slow pair is new, but the estimate (1 Gbit/s) is faster than the history's mean: the
    futures are not scaled (by less than 1 either)."""
    cs = make_chunks(2)
    history = [A, A, A, B, B, A, A, A]
    for budget in thresholds(cs, 1.0, SLOW):
        got = decide(
            "adaptive",
            cs,
            COSTS,
            time_left_s=budget,
            history_s_per_bit=history,
            risk_quantile=1.0,
            **dkw(est_gbps=1.0),
        )
        assert got == even_choice(cs, budget, 1.0, SLOW), budget


def test_a_history_of_integers_plans_as_the_same_floats():
    """Seconds per bit given as ints (a very slow link: 1 or 3 s per bit; payloads of a few bytes)."""
    cs = [PlanChunk(i, i * TOKENS, TOKENS, 0, {1: 4, 2: 2, 3: 1}) for i in range(3)]
    ints = [1, 1, 1, 3, 3, 1, 1, 1]
    for budget in (30.0, 100.0, 200.0, 1000.0):
        args = dict(time_left_s=budget, risk_quantile=0.9, **dkw())
        as_int = decide("adaptive", cs, COSTS, history_s_per_bit=ints, **args)
        assert as_int == decide("adaptive", cs, COSTS, history_s_per_bit=[float(x) for x in ints], **args)


# -- decide(): the loader's state reaches the plan -----------------------------------------------


def test_decide_plans_adaptive_from_the_compute_backlog_and_the_allowed_levels():
    """Decodes of 4, 3 and 2 ms (levels 1-3). Idle, level 1 for both chunks ends at 44 ms and fits
    50 ms; behind 1 s of queued work nothing fits, and the soonest end is level 3 (1.004 s)."""
    costs = CostModel(
        decode_s_per_mvalue={1: 0.004, 2: 0.003, 3: 0.002},
        decode_fixed_s=0.0,
        recompute_fixed_s=0.01,
        recompute_s_per_token=1e-3,
        recompute_s_per_token_ctx=0.0,
        fetch_latency_s=0.0,
    )
    cs = [PlanChunk(i, i * TOKENS, TOKENS, 1_000_000, dict(SIZES)) for i in range(2)]
    args = dict(time_left_s=0.05, est_gbps=G, last_gbps=G, tail_gbps=G, known=True)
    assert decide("adaptive", cs, costs, cpu_busy_s=0.0, **args) == 1
    assert decide("adaptive", cs, costs, cpu_busy_s=1.0, **args) == 3
    assert decide("adaptive", cs, costs, cpu_busy_s=0.0, allowed=(2, 3), **args) == 2
