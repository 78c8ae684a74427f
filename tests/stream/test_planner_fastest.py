"""choose_fastest (the ``fastest`` policy) against its description, on a few hundred small random
ladders: each of the chunk's undominated options, followed by the next ``horizon`` chunks either
greedily (each at the option that ends its compute soonest, then frees the link soonest) or all at
one format (a chunk without it: its greedy option); the earliest end wins, ties to the earlier
option, unless the head and the rest at one format (the best such, ties to the earlier) ends within
``MIX_MARGIN`` of it and meets the deadline whenever the winner does: then that format. The oracle times plans with :mod:`stream.plan_oracle` (the cost model only); a brute force
over every plan bounds the prediction from below."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from cachegen.stream import decide
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.planner import FASTEST_HORIZON, MIX_MARGIN, PipelineState, PlanChunk, choose_fastest
from stream.plan_oracle import COSTS, EXACT, make_chunks, run, step, undominated


def soonest(c, opts, gbps, costs, net, cpu, prev):
    """(link free, compute free, option) after ``c`` at whichever of ``opts`` ends its compute
    first (then frees the link first; then the earlier option); ``prev``: the chunk before's option."""
    best = None
    for o in opts:
        n, p = step(net, cpu, c, o, gbps, costs, prev)
        if best is None or (p, n) < (best[1], best[0]):
            best = (n, p, o)
    return best


def head_ends(remaining, gbps, costs, state, allowed=None, tail_gbps=None, horizon=FASTEST_HORIZON):
    """{head option: (its compute end, {continuation ("greedy" or a format): the window's end})}."""
    tg = gbps if tail_gbps is None else tail_gbps
    window = remaining[: horizon + 1]
    options = [undominated(c, costs, allowed) for c in window]
    formats = [o for o in options[0] if o != TEXT]
    out = {}
    for o in options[0]:
        net0, cpu0 = step(state.net_busy_s, state.cpu_busy_s, window[0], o, gbps, costs, state.prev)
        net, cpu, prev = net0, cpu0, o
        for c, opts in zip(window[1:], options[1:]):
            net, cpu, prev = soonest(c, opts, tg, costs, net, cpu, prev)
        ends = {"greedy": cpu}
        for f in formats:
            net, cpu, prev = net0, cpu0, o
            for c, opts in zip(window[1:], options[1:]):
                if f in c.sizes:
                    net, cpu = step(net, cpu, c, f, tg, costs, prev)
                    prev = f
                else:
                    net, cpu, prev = soonest(c, opts, tg, costs, net, cpu, prev)
            ends[f] = cpu
        out[o] = (cpu0, ends)
    return out


def oracle(remaining, gbps, costs, state, allowed=None, tail_gbps=None, horizon=FASTEST_HORIZON, left=math.inf):
    """(choice, its compute end, predicted end, whether a mix was given up for one format)."""
    heads = head_ends(remaining, gbps, costs, state, allowed, tail_gbps, horizon)
    best = None
    for o, (cpu0, ends) in heads.items():
        total = min(ends.values())
        if best is None or total < best[2]:
            best = (o, cpu0, total)
    single = None  # the head whose own format for every chunk ends soonest
    for o, (_cpu0, ends) in heads.items():
        if o != TEXT and (single is None or ends[o] < heads[single][1][single]):
            single = o
    if single is not None and single != best[0]:
        total = min(heads[single][1].values())
        if best[2] > (1 - MIX_MARGIN) * total and (total <= left or best[2] > left):
            return single, heads[single][0], total, True
    return (*best, False)


def random_case(rng: random.Random):
    n = rng.randint(1, 5)
    levels = rng.sample(range(4), rng.randint(1, 4))
    per_mv = {l: rng.choice([0.0005, 0.002, 0.004, 0.008]) for l in range(4)}
    twin = rng.random() < 0.2  # level 3 costs exactly what level 0 costs: the two tie
    if twin:
        per_mv[3] = per_mv[0]
        levels = sorted({*levels, 0, 3})
    # half the cases: a chunk that joins a waiting batch of its level decodes at another rate
    batched = {l: per_mv[l] * rng.choice([0.1, 0.5, 2.0]) for l in range(4)} if rng.random() < 0.5 else {}
    if twin and batched:
        batched[3] = batched[0]
    costs = CostModel(
        decode_s_per_mvalue=per_mv,
        decode_batched_s_per_mvalue=batched,
        decode_fixed_s=rng.choice([0.0, 0.001]),
        recompute_fixed_s=0.002,
        recompute_s_per_token=rng.choice([2e-5, 1e-4, 1e-3]),
        recompute_s_per_token_ctx=rng.choice([0.0, 1e-7]),
        fetch_latency_s=rng.choice([0.0, 0.0005]),
    )
    chunks, start = [], 0
    for i in range(n):
        tokens = rng.choice([16, 64, 128])
        stored = [l for l in levels if rng.random() < 0.85] if i else levels
        sizes = {l: rng.randint(1, 400) * 1000 for l in stored}
        if twin and 0 in sizes and 3 in sizes:
            sizes[3] = sizes[0]
        chunks.append(PlanChunk(i, start, tokens, 1_000_000, sizes))
        start += tokens
    gbps = 10 ** rng.uniform(-3, 0.5)
    tail = rng.choice([None, 10 ** rng.uniform(-3, 0.5)])
    state = PipelineState(
        math.inf,
        cpu_busy_s=rng.choice([0.0, 0.01, 0.05]),
        net_busy_s=rng.choice([0.0, 0.005]),
        prev=rng.choice([None, TEXT, *levels]),
    )
    allowed = rng.choice([None, None, tuple(rng.sample(range(4), 2))])
    horizon = rng.choice([0, 1, 2, 3, 24])
    # half the cases: a fetch that begins while the compute stage is busy takes CPU from it (picked
    # by the rate's digits, not drawn: every case is the one the draws above always gave)
    costs.fetch_cpu_s_per_mb = (0.0, 0.0, 0.002, 0.05)[int(gbps * 1e6) % 4]
    return chunks, gbps, costs, state, allowed, tail, horizon


def test_choose_fastest_follows_its_description():
    rng = random.Random(20261201)
    seen = {"tie": 0, "cut": 0, "exact": 0, "single": 0}
    for _ in range(400):
        chunks, gbps, costs, state, allowed, tail, horizon = random_case(rng)
        heads = head_ends(chunks, gbps, costs, state, allowed, tail, horizon)
        total = oracle(chunks, gbps, costs, state, allowed, tail, horizon)[2]
        # the deadline sets `fits` (at the predicted end exactly it fits, a little before it not)
        # and whether a mix may be given up for a single format that would miss it
        left = rng.choice([math.inf, total, total * (1 - 1e-9)])
        choice, finish, total, single = oracle(chunks, gbps, costs, state, allowed, tail, horizon, left)
        st = PipelineState(left, state.cpu_busy_s, state.net_busy_s, state.prev)
        p = choose_fastest(chunks, gbps, costs, st, allowed, tail_gbps=tail, horizon=horizon)
        assert (p.choice, p.finish_s, p.total_s, p.fits) == (choice, finish, total, total <= left), (
            chunks,
            gbps,
            tail,
            allowed,
            horizon,
        )
        seen["tie"] += sum(1 for o, (_, e) in heads.items() if o != choice and min(e.values()) == total)
        seen["cut"] += len(chunks) > horizon + 1
        seen["exact"] += left == total
        seen["single"] += single
    # the cases hold heads that tie (the earlier wins), a horizon cutting the load short, a deadline
    # at the predicted end exactly, a mix given up for one format
    assert all(v > 5 for v in seen.values()), seen


def test_choose_fastest_is_no_later_than_the_best_plan_and_no_earlier_than_it_can_be():
    """Over every plan of up to 4 chunks: the prediction is at least the best plan's end (it is the
    end of one plan), and at most the end of every plan that keeps one format for all chunks."""
    rng = random.Random(7)
    for _ in range(60):
        chunks, gbps, costs, state, allowed, tail, _ = random_case(rng)
        chunks = chunks[:4]
        tg = gbps if tail is None else tail
        p = choose_fastest(chunks, gbps, costs, state, allowed, tail_gbps=tail)
        rates = [gbps, *[tg] * (len(chunks) - 1)]
        per = [[*[l for l in sorted(c.sizes) if allowed is None or l in allowed], TEXT] for c in chunks]
        ends = {
            plan: run(chunks, plan, rates, costs, state.net_busy_s, state.cpu_busy_s, state.prev)[1]
            for plan in itertools.product(*per)
        }
        assert p.total_s >= min(ends.values()) - 1e-12
        for f in undominated(chunks[0], costs, allowed)[:-1]:  # the formats: one of them for every chunk
            if all(f in opts for opts in per):
                assert p.total_s <= ends[(f,) * len(chunks)], f


def test_equal_heads_go_to_the_better_level_and_an_empty_load_is_refused():
    twin = PlanChunk(0, 0, 1, 0, {1: 125_000_000, 2: 125_000_000})  # two levels, the same costs
    p = choose_fastest([twin], 1.0, EXACT, PipelineState(1.5))
    assert (p.choice, p.finish_s, p.total_s, p.fits) == (1, 1.5, 1.5, True)
    assert not choose_fastest([twin], 1.0, EXACT, PipelineState(1.25)).fits
    with pytest.raises(ValueError, match=r"^no chunk to plan$"):
        choose_fastest([], 1.0, EXACT, PipelineState(1.0))


def test_the_horizon_bounds_the_prediction():
    cs = make_chunks(4)
    p0 = choose_fastest(cs, 0.1, COSTS, PipelineState(math.inf), horizon=0)
    p1 = choose_fastest(cs, 0.1, COSTS, PipelineState(math.inf), horizon=1)
    # every chunk's fastest level is the smallest: 5 ms a fetch, 2 ms a decode
    assert (p0.choice, p0.total_s) == (3, pytest.approx(0.007, abs=1e-12))
    assert (p1.choice, p1.total_s) == (3, pytest.approx(0.012, abs=1e-12))
    assert choose_fastest(cs, 0.1, COSTS, PipelineState(math.inf)).total_s == pytest.approx(0.022, abs=1e-12)


def test_decide_fastest_is_choose_fastest_from_the_loader_state():
    rng = random.Random(11)
    for _ in range(150):
        chunks, gbps, costs, state, allowed, tail, _ = random_case(rng)
        left = rng.choice([None, 0.0, 1.0])
        st = PipelineState(math.inf if left is None else left, cpu_busy_s=state.cpu_busy_s)
        want = oracle(chunks, gbps, costs, st, allowed, tail if tail is not None else gbps)[0]
        got = decide(
            "fastest",
            chunks,
            costs,
            time_left_s=left,
            cpu_busy_s=state.cpu_busy_s,
            est_gbps=gbps,
            last_gbps=gbps / 3,
            tail_gbps=tail if tail is not None else gbps,
            known=True,
            allowed=allowed,
        )
        assert got == want, (chunks, gbps, tail, allowed, state.cpu_busy_s)


def test_decide_fastest_waits_out_a_busy_compute_stage_with_the_cheap_decode():
    """Two formats: 1 is big and fast to decode (50 + 1 ms), 2 small and slow (5 + 10 ms). With the
    compute stage idle, 2 ends the chunk first; behind 1 s of queued work, 1 does."""
    costs = CostModel(
        decode_s_per_mvalue={1: 0.001, 2: 0.01},
        decode_fixed_s=0.0,
        recompute_fixed_s=0.01,
        recompute_s_per_token=1e-3,
        recompute_s_per_token_ctx=0.0,
        fetch_latency_s=0.0,
    )
    c = PlanChunk(0, 0, 256, 1_000_000, {1: 625_000, 2: 62_500})
    args = dict(time_left_s=None, est_gbps=0.1, last_gbps=0.1, tail_gbps=0.1, known=True)
    assert decide("fastest", [c], costs, cpu_busy_s=0.0, **args) == 2
    assert decide("fastest", [c], costs, cpu_busy_s=1.0, **args) == 1
    assert decide("fastest", [c], costs, cpu_busy_s=0.0, **{**args, "time_left_s": 0.001}) == 2


def test_a_mix_that_saves_less_than_the_margin_gives_way_to_one_format(monkeypatch):
    """At 10 Gbit/s, 8-bit KV (3 MB, 1 ms to decode) against L7 (0.2 MB, 12 ms): L7 for the first
    chunk saves one big fetch, 2.24 ms of 49 (4.6%), within the margin: every chunk takes 8-bit KV.
    Without the margin the mix would be taken."""
    from cachegen.stream import planner

    costs = CostModel(decode_s_per_mvalue={1: 0.001, 7: 0.012}, decode_fixed_s=0.0, fetch_latency_s=0.0)
    chunks = [PlanChunk(i, 256 * i, 256, 1_000_000, {1: 3_000_000, 7: 200_000}) for i in range(20)]
    p = choose_fastest(chunks, 10.0, costs, PipelineState(math.inf))
    assert p.choice == 1 and p.total_s == pytest.approx(0.049)
    monkeypatch.setattr(planner, "MIX_MARGIN", 0.0)
    p = choose_fastest(chunks, 10.0, costs, PipelineState(math.inf))
    assert p.choice == 7 and p.total_s == pytest.approx(0.04676)
    # a deadline only the mix meets keeps the mix
    monkeypatch.setattr(planner, "MIX_MARGIN", 0.05)
    p = choose_fastest(chunks, 10.0, costs, PipelineState(0.048))
    assert p.choice == 7 and p.fits


def test_a_deadline_the_single_format_misses_makes_the_fastest_decision_take_the_mix():
    """The fastest policy reads the time left only through the mix margin's deadline test: the
    mix of the test above, within the margin, is given up for 8-bit KV alone with no deadline,
    and kept with a deadline only the mix meets (0.048 s: 8-bit KV alone ends at 0.049 s, the mix
    at 0.0468 s), through ``decide`` as through ``decide_fastest``."""
    from cachegen.stream.planner import decide_fastest

    costs = CostModel(decode_s_per_mvalue={1: 0.001, 7: 0.012}, decode_fixed_s=0.0, fetch_latency_s=0.0)
    chunks = [PlanChunk(i, 256 * i, 256, 1_000_000, {1: 3_000_000, 7: 200_000}) for i in range(20)]
    args = dict(cpu_busy_s=0.0, est_gbps=10.0, tail_gbps=10.0, known=True)
    for left, want in ((None, 1), (0.048, 7), (0.0495, 1)):
        assert decide_fastest(chunks, costs, time_left_s=left, **args)[0] == want, left
        assert decide("fastest", chunks, costs, time_left_s=left, last_gbps=10.0, **args) == want, left


def test_a_mix_that_saves_exactly_the_margin_is_taken(monkeypatch):
    """The mix must save at least the margin: saving it exactly keeps the mix."""
    from cachegen.stream import planner

    costs = CostModel(decode_s_per_mvalue={1: 0.001, 7: 0.012}, decode_fixed_s=0.0, fetch_latency_s=0.0)
    chunks = [PlanChunk(i, 256 * i, 256, 1_000_000, {1: 3_000_000, 7: 200_000}) for i in range(20)]
    monkeypatch.setattr(planner, "MIX_MARGIN", 0.0)
    mix = choose_fastest(chunks, 10.0, costs, PipelineState(math.inf)).total_s
    one = choose_fastest(chunks, 10.0, costs, PipelineState(math.inf), [1]).total_s
    margin = 1 - mix / one
    while (1 - margin) * one != mix:  # the margin whose saving equals the mix's, to the last bit
        margin = math.nextafter(margin, 1.0 if (1 - margin) * one > mix else 0.0)
    monkeypatch.setattr(planner, "MIX_MARGIN", margin)
    assert choose_fastest(chunks, 10.0, costs, PipelineState(math.inf)).choice == 7
    while (1 - margin) * one >= mix:  # the next margin that asks for more
        margin = math.nextafter(margin, 1.0)
    monkeypatch.setattr(planner, "MIX_MARGIN", margin)
    assert choose_fastest(chunks, 10.0, costs, PipelineState(math.inf)).choice == 1
