"""The batched decode model: a chunk that waits in the loader's queue is decoded with the others
that wait, at its share of one call (``CostModel.decode_batched_s_per_mvalue``). Held against
values worked out by hand and the pipeline timer of :mod:`stream.plan_oracle`; the calibration
times the codec's ``decode_many_into``; the replay decodes waiting chunks in one call too."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from cachegen.bench.replay import replay_load
from cachegen.codec import Codec, calibrate
from cachegen.kv import KVCache, KVLayer
from cachegen.stream import LoaderOptions, ThroughputEstimator, make_trace
from cachegen.stream.costs import TEXT, CostModel, calibrate_decode
from cachegen.stream.planner import (
    PipelineState,
    PlanChunk,
    cheapest_tail,
    choose_adaptive,
    choose_fastest,
    decide,
    finish_quantile,
    simulate,
    tail_at,
    useful_options,
)
from stream.fakes import ToyCodec
from stream.plan_oracle import end, undominated

# whole milliseconds: a fetch of 125 kB at 1 Gbit/s is 1 ms; a decode 10 ms alone, 2 ms batched
COSTS = CostModel(
    decode_s_per_mvalue={1: 0.0},
    decode_s_per_mvalue_default=0.0,
    decode_fixed_s=0.010,
    decode_batched_s_per_mvalue={1: 0.002 / 1.0},  # 1 M values a chunk below
    recompute_fixed_s=1.0,
    recompute_s_per_token=0.0,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)


def chunks(n: int) -> list[PlanChunk]:
    return [PlanChunk(i, 256 * i, 256, 1_000_000, {1: 125_000}) for i in range(n)]


def test_decode_s_takes_the_batched_rate_only_where_a_level_has_one():
    assert COSTS.decode_s(1, 1_000_000) == pytest.approx(0.010)
    assert COSTS.decode_s(1, 1_000_000, batched=True) == pytest.approx(0.002)
    assert COSTS.decode_s(2, 1_000_000, batched=True) == COSTS.decode_s(2, 1_000_000)  # no batched rate: alone
    back = CostModel.from_json(COSTS.to_json())
    assert back.decode_batched_s_per_mvalue == {1: pytest.approx(0.002)} and back == COSTS
    old = COSTS.to_json()
    del old["decode_batched_s_per_mvalue"]  # a model cached before the field: every decode alone
    assert CostModel.from_json(old).decode_batched_s_per_mvalue == {}


def test_a_chunk_that_arrives_while_the_compute_stage_is_busy_costs_its_batched_share():
    # chunk 0 arrives at 1 ms and decodes alone until 11 ms; chunks 1-3 arrive at 2, 3, 4 ms and
    # wait: 2 ms each -> 17 ms
    cs = chunks(4)
    assert simulate(cs, [1] * 4, 1.0, COSTS) == pytest.approx(0.017)
    assert end(cs, [1] * 4, 1.0, costs=COSTS) == pytest.approx(0.017)  # the oracle agrees
    # on a slow link each chunk arrives after the last decode: all alone (fetch 100 ms, decode 10 ms)
    assert simulate(cs, [1] * 4, 0.01, COSTS) == pytest.approx(0.410)
    # compute committed before the first chunk: it joins the batch of a chunk of its level, not another's
    assert simulate(cs[:1], [1], 1.0, COSTS, PipelineState(1.0, cpu_busy_s=0.005, prev=1)) == pytest.approx(0.007)
    assert simulate(cs[:1], [1], 1.0, COSTS, PipelineState(1.0, cpu_busy_s=0.005, prev=2)) == pytest.approx(0.015)
    # a chunk of another level between them ends the batch: chunk 2 (level 2, 10 ms alone) and chunk 3
    mixed = [*cs[:2], replace(cs[2], sizes={2: 125_000}), cs[3]]
    assert simulate(mixed, [1, 1, 2, 1], 1.0, COSTS) == pytest.approx(0.011 + 0.002 + 0.010 + 0.010)
    assert end(mixed, [1, 1, 2, 1], 1.0, costs=COSTS) == pytest.approx(0.033)


def test_finish_quantile_prices_a_waiting_chunk_at_its_batched_share():
    cs = chunks(3)
    futures = np.array([[1e-9, 1e-9], [1e-7, 1e-7]])  # 1 Gbit/s later, or 10 Mbit/s (100 ms a fetch)
    st = PipelineState(1.0)
    fast = finish_quantile(cs, [1] * 3, 1e-9, futures[:1], COSTS, st, 0.5)
    assert fast == pytest.approx(simulate(cs, [1] * 3, 1.0, COSTS)) == pytest.approx(0.015)
    slow = finish_quantile(cs, [1] * 3, 1e-9, futures[1:], COSTS, st, 0.5)
    assert slow == pytest.approx(0.001 + 0.2 + 0.010)  # the later chunks arrive after the decodes: alone


def test_a_level_beaten_alone_but_not_batched_stays_an_option():
    c = PlanChunk(0, 0, 256, 1_000_000, {1: 100_000, 2: 100_000})
    costs = replace(COSTS, decode_s_per_mvalue={1: 0.001, 2: 0.0}, decode_batched_s_per_mvalue={1: 0.001, 2: 0.005})
    assert useful_options(c, costs) == undominated(c, costs) == [1, 2, TEXT]  # 1 is slower alone, faster batched
    costs = replace(costs, decode_batched_s_per_mvalue={1: 0.001, 2: 0.001})
    assert useful_options(c, costs) == undominated(c, costs) == [2, TEXT]


def test_the_fastest_policy_counts_on_batching_when_the_link_runs_ahead():
    """A compact format slow to decode alone but cheap in a batch, against a big one cheap to
    decode: on a fast link the compact chunks queue up and decode together."""
    cs = [PlanChunk(i, 256 * i, 256, 1_000_000, {0: 1_250_000, 1: 125_000}) for i in range(8)]
    # at 1 Gbit/s raw fetches take 10 ms and decode in 1 ms; compact ones take 1 ms and decode in 12 ms alone, 2 batched
    costs = replace(
        COSTS,
        decode_fixed_s=0.0,
        decode_s_per_mvalue={0: 0.001, 1: 0.012},
        decode_batched_s_per_mvalue={0: 0.001, 1: 0.002},
    )
    pred = choose_fastest(cs, 1.0, costs, PipelineState(1.0))
    # compact throughout: the first alone, the seven that wait for it in one batch
    assert pred.choice == 1 and pred.total_s == pytest.approx(0.001 + 0.012 + 7 * 0.002)
    assert end(cs, [1] * 8, 1.0, costs=costs) == pytest.approx(pred.total_s)  # the oracle's time of that plan
    # without batching the best it sees is compact first, then raw (arriving at 11, 21, ... 71 ms)
    alone = replace(costs, decode_batched_s_per_mvalue={})
    assert choose_fastest(cs, 1.0, alone, PipelineState(1.0)).total_s == pytest.approx(0.072)


# -- calibration and the replay ---------------------------------------------------------------


def _kv(seed: int, tokens: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache([KVLayer(torch.randn(2, tokens, 16, generator=g), torch.randn(2, tokens, 16, generator=g))])


def test_calibration_times_a_codec_that_decodes_many_in_one_call():
    codec = Codec(calibrate([_kv(1, 96), _kv(2, 96)], "fp-batched"), "fp-batched", threads=1)
    cm = calibrate_decode(codec, _kv(3, 32), (3, 7), repeats=1, batch=4)
    assert set(cm.decode_batched_s_per_mvalue) == {3, 7}
    for level in (3, 7):  # a chunk's share of a batch is never costed above its decode alone
        assert 0 < cm.decode_s(level, 32 * 64, batched=True) <= cm.decode_s(level, 32 * 64)
    toy = calibrate_decode(ToyCodec(), _kv(3, 32), (0, 1), repeats=1)
    assert toy.decode_batched_s_per_mvalue == {}  # one chunk at a time: every decode alone
    assert calibrate_decode(codec, _kv(3, 32), (3,), repeats=1, batch=1).decode_batched_s_per_mvalue == {}


def test_the_replay_decodes_waiting_chunks_in_one_call_the_first_alone_the_rest_batched():
    cs = [PlanChunk(i, 256 * i, 256, 1_000_000, {1: 125_000}) for i in range(8)]
    opts = LoaderOptions(policy=1, slo_s=None, recency_boost=0)
    trace = make_trace("constant:10", len(cs))

    def load(costs: CostModel) -> float:
        est = ThroughputEstimator(prior_gbps=10.0)
        ends = replay_load(cs, trace, costs, opts, estimator=est, cpu_noise=0.0).compute_end
        return max(e for e in ends if e is not None)

    alone = replace(COSTS, decode_batched_s_per_mvalue={})
    # 0.1 ms fetches: chunk 0 decodes alone (10 ms), the other seven wait: 7 x 10 ms alone, or one
    # call in which the first pays 10 ms (the call's fixed part) and the six others 2 ms each
    assert load(alone) == pytest.approx(0.0801, abs=2e-3)
    assert load(COSTS) == pytest.approx(0.0321, abs=2e-3)


# -- the choice of the chunk before, through every planning path ---------------------------------


def test_the_tails_carry_the_choice_of_the_chunk_before():
    cs = chunks(4)
    # the head arrived at 1 ms and decodes until 11 ms: a tail of level 1 after level 1 waits, batched
    assert tail_at(cs[1:], 1, 1.0, COSTS, 0.001, 0.011, None, 1) == pytest.approx(0.011 + 3 * 0.002)
    assert tail_at(cs[1:], 1, 1.0, COSTS, 0.001, 0.011, None, 2) == pytest.approx(0.011 + 0.010 + 2 * 0.002)
    _, cpu, picks = cheapest_tail(cs[1:], 1.0, COSTS, 0.001, 0.011, None, 1)
    assert picks == [1, 1, 1] and cpu == pytest.approx(0.017)
    assert cheapest_tail(cs[1:], 1.0, COSTS, 0.001, 0.011, None, 2)[1] == pytest.approx(0.025)
    # chunks without the planned level take their fastest option, which carries on as ``prev`` too
    only2 = [replace(c, sizes={2: 125_000}) for c in cs[1:3]]
    two = replace(COSTS, decode_batched_s_per_mvalue={1: 0.002, 2: 0.003})
    assert tail_at(only2, 1, 1.0, two, 0.001, 0.011, None, 2) == pytest.approx(0.011 + 2 * 0.003)
    assert tail_at(only2, 1, 1.0, two, 0.001, 0.011, None, 1) == pytest.approx(0.011 + 0.010 + 0.003)


def test_a_chunk_that_arrives_as_the_compute_stage_frees_decodes_alone():
    # 4 GB at 8 Gbit/s: 4 s; 2 GB: 2 s; 2 s alone, 1 s batched: chunk 1 arrives at 6 s, when chunk 0 ends
    costs = CostModel(
        decode_s_per_mvalue={1: 0.0},
        decode_fixed_s=2.0,
        decode_batched_s_per_mvalue={1: 1.0},
        fetch_latency_s=0.0,
        recompute_fixed_s=100.0,
        recompute_s_per_token=0.0,
        recompute_s_per_token_ctx=0.0,
    )
    cs = [PlanChunk(0, 0, 8, 1_000_000, {1: 4_000_000_000}), PlanChunk(1, 8, 8, 1_000_000, {1: 2_000_000_000})]
    assert simulate(cs, [1, 1], 8.0, costs) == 8.0
    tail = np.array([[1.0 / 8e9]])
    assert finish_quantile(cs, [1, 1], 1.0 / 8e9, tail, costs, PipelineState(1.0), 0.5) == 8.0


def test_finish_quantile_joins_a_batch_only_behind_its_level():
    cs = [*chunks(2), replace(chunks(3)[2], sizes={2: 125_000}), chunks(4)[3]]
    plan = [1, 1, 2, 1]
    futures = np.array([[1e-9] * 3])
    st = PipelineState(1.0)
    want = 0.011 + 0.002 + 0.010 + 0.010  # chunk 2 (level 2) and chunk 3 (after level 2) decode alone
    assert finish_quantile(cs, plan, 1e-9, futures, COSTS, st, 0.5) == pytest.approx(want)
    assert simulate(cs, plan, 1.0, COSTS) == pytest.approx(want)
    # committed compute of level 1 before the head: it joins that batch
    busy = PipelineState(1.0, cpu_busy_s=0.005, prev=1)
    assert finish_quantile(cs[:1], [1], 1e-9, futures[:, :0], COSTS, busy, 0.5) == pytest.approx(0.007)


def test_decide_plans_from_the_choice_of_the_chunk_before():
    """One chunk left, compute busy for 5 ms behind a chunk of level 1: level 1 joins its batch
    (1 + 2 ms: ends at 7 ms) where raw (level 0: 10 ms fetch, 1 ms decode) ends at 11 ms; after a
    chunk of another level, level 1 decodes alone (5 + 12 = 17 ms) and raw wins."""
    ch = [PlanChunk(0, 0, 256, 1_000_000, {0: 1_250_000, 1: 125_000})]
    costs = replace(
        COSTS,
        decode_fixed_s=0.0,
        decode_s_per_mvalue={0: 0.001, 1: 0.012},
        decode_batched_s_per_mvalue={0: 0.001, 1: 0.002},
    )
    kw = dict(cpu_busy_s=0.005, est_gbps=1.0, last_gbps=1.0, tail_gbps=1.0, known=True)
    assert decide("fastest", ch, costs, time_left_s=None, prev=1, **kw) == 1
    assert decide("fastest", ch, costs, time_left_s=None, prev=0, **kw) == 0
    assert decide("adaptive", ch, costs, time_left_s=0.008, prev=1, **kw) == 1  # only the batch fits
    assert decide("adaptive", ch, costs, time_left_s=0.008, prev=0, **kw) == 0  # nothing fits: the soonest


def test_the_adaptive_plan_prices_its_head_and_tails_with_the_chunk_before():
    cs = chunks(4)
    busy = PipelineState(0.015, cpu_busy_s=0.005, prev=1)
    p = choose_adaptive(cs, 1.0, COSTS, busy)
    # head: arrives at 1 ms, joins the busy batch: 7 ms; the three after it batched: 13 ms
    assert (p.choice, p.finish_s, p.total_s, p.fits) == (1, pytest.approx(0.007), pytest.approx(0.013), True)
    late = replace(busy, time_left_s=0.0)  # nothing fits: the soonest, with the same prices
    p = choose_adaptive(cs, 1.0, COSTS, late)
    assert (p.choice, p.total_s, p.fits) == (1, pytest.approx(0.013), False)
    alone = choose_adaptive(cs, 1.0, COSTS, replace(busy, prev=2))
    assert (alone.finish_s, alone.total_s, alone.fits) == (pytest.approx(0.015), pytest.approx(0.021), False)


def test_every_pipeline_model_takes_a_fetch_s_cpu_from_a_busy_compute_stage_only():
    """One chunk fetched in 0.25 s (250 MB at 8 Gbit/s) whose fetch takes 0.5 s of the compute
    stage's time if it is busy as the fetch begins, then decoded in 2 s: from a stage that frees
    just as the fetch begins it ends at 3.25 s, from one busy until 1.25 s at 3.75 s, in the plain
    model (simulate, through _step) and the risk model (finish_quantile) alike."""
    costs = CostModel(
        decode_s_per_mvalue={1: 0.0},
        decode_fixed_s=2.0,
        fetch_latency_s=0.0,
        fetch_cpu_s_per_mb=0.002,
        recompute_fixed_s=100.0,
        recompute_s_per_token=0.0,
        recompute_s_per_token_ctx=0.0,
    )
    cs = [PlanChunk(0, 0, 8, 1_000_000, {1: 250_000_000})]
    none = np.empty((1, 0))
    for cpu, want in ((1.0, 3.25), (1.25, 3.75)):
        st = PipelineState(10.0, cpu_busy_s=cpu, net_busy_s=1.0)
        assert simulate(cs, [1], 8.0, costs, st) == pytest.approx(want)
        assert finish_quantile(cs, [1], 1.0 / 8e9, none, costs, st, 0.5) == pytest.approx(want)
