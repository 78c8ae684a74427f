"""The ``fastest`` policy over a ladder of formats: per chunk the format (or text) that ends the
load soonest by the cost model. Virtual time: the toy codecs and model take exactly what the
cost model says, so the choices and the load time are the model's."""

from __future__ import annotations

import pytest
import torch

from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import (
    FASTEST,
    CostModel,
    FormatLadder,
    LoaderOptions,
    PlanChunk,
    Rung,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    VirtualClock,
    VirtualRunner,
    choose_fastest,
    constant,
    simulate,
)
from cachegen.stream.costs import TEXT
from cachegen.stream.planner import PipelineState, useful_options
from stream.fakes import FaultyStore, ToyCodec, ToyModel

CHUNK = 32
N_CHUNKS = 6
VALUES = 2 * 2 * 2 * CHUNK * 8  # ToyModel(): 2 layers, K and V, 2 heads, 8 dims
RAW_S, COMPACT_S = 0.0001, 0.004  # decode seconds per chunk: raw float32, 2-bit
LATENCY_S = 0.0  # the estimator measures latency into its rate: with none the rate is the link's
RAW, COMPACT = 0, 1  # ladder levels


def ladder(sleep=None) -> FormatLadder:
    kw = {"sleep": sleep} if sleep else {}
    return FormatLadder(
        [
            Rung("raw32", ToyCodec(delay_s_per_mvalue=RAW_S / (VALUES / 1e6), **kw), 0),
            Rung("toy2", ToyCodec(delay_s_per_mvalue=COMPACT_S / (VALUES / 1e6), **kw), 4),
        ]
    )


def costs(recompute_s_per_token: float) -> CostModel:
    """Exactly what the virtual parts take."""
    return CostModel(
        decode_s_per_mvalue={RAW: RAW_S / (VALUES / 1e6), COMPACT: COMPACT_S / (VALUES / 1e6)},
        decode_fixed_s=0.0,
        recompute_fixed_s=0.0,
        recompute_s_per_token=recompute_s_per_token,
        recompute_s_per_token_ctx=0.0,
        fetch_latency_s=LATENCY_S,
    )


@pytest.fixture
def stored(tmp_path):
    model = ToyModel()
    tokens = [(11 * i + 2) % 89 for i in range(N_CHUNKS * CHUNK)]
    kv = model.full(tokens, CHUNK)
    lad = ladder()
    store = ContextStore(open_backend(f"file://{tmp_path / 'store'}"), Namespace("toy", 1, "ladder"), lad, CHUNK)
    store.put_context(tokens, kv, levels=lad.levels)
    yield store, tokens, kv
    store.backend.close()


def virtual_load(store, tokens, gbps: float, policy, recompute_s_per_token: float = 0.01):
    clock = VirtualClock()
    model = ToyModel(s_per_token=recompute_s_per_token, sleep=clock.sleep)
    loader = StreamingLoader(
        store,
        ladder(clock.sleep),
        model.recompute,
        LoaderOptions(policy=policy, slo_s=None, values_per_token=VALUES // CHUNK),
        costs=costs(recompute_s_per_token),
        link=ThrottledLink(constant(gbps), latency_s=LATENCY_S, clock=clock, sleep=clock.sleep),
        estimator=ThroughputEstimator(prior_gbps=gbps, min_bytes=0),
        clock=clock,
        runner=VirtualRunner(clock),
    )
    return loader.load(tokens, t0=0.0)


def test_the_ladder_round_trips_each_rung_and_refuses_a_foreign_tag(stored):
    kv = stored[2]
    lad = ladder()
    part = kv.slice(0, CHUNK)
    for level, r in enumerate(lad.rungs):
        blob = lad.encode(part, level, key="k")
        want = r.codec.decode(r.codec.encode(part, r.level, key="k"), key="k")
        got = lad.decode(blob, key="k")
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(got.layers, want.layers))
        out = KVCache.allocate(part, CHUNK)
        lad.decode_into(blob, out, key="k")
        assert all(torch.equal(a.k, b.k) for a, b in zip(out.layers, want.layers))
        assert lad.label(level) == r.label and lad.level_of(r.label) == level
    with pytest.raises(CorruptChunk):
        lad.decode(bytes([7]) + lad.encode(part, 0)[1:])
    with pytest.raises(ConfigError):
        FormatLadder([Rung("x", ToyCodec(), 9)])
    with pytest.raises(ConfigError):
        FormatLadder([Rung("x", ToyCodec(), 0), Rung("x", ToyCodec(), 1)])


def test_a_slow_link_takes_the_compact_format(stored):
    store, tokens, _ = stored
    res = virtual_load(store, tokens, gbps=0.001, policy=FASTEST)  # 1 Mbit/s: raw is 8 KB = 66 ms a chunk
    assert res.choices == [COMPACT] * N_CHUNKS and not res.faults


def test_a_fast_link_takes_raw_kv(stored):
    store, tokens, _ = stored
    res = virtual_load(store, tokens, gbps=10.0, policy=FASTEST)  # fetches of microseconds: decode decides
    assert res.choices == [RAW] * N_CHUNKS and not res.faults


def test_cheap_recompute_takes_text_where_it_ends_the_load_sooner(stored):
    store, tokens, kv = stored
    res = virtual_load(store, tokens, gbps=0.001, policy=FASTEST, recompute_s_per_token=1e-6)
    assert res.choices == [TEXT] * N_CHUNKS
    assert all(torch.allclose(a.k, b.k) for a, b in zip(res.kv.layers, kv.layers))


def test_the_load_ends_no_later_than_any_single_format(stored):
    """At a rate where neither format wins on its own (raw is link-bound, the compact one
    CPU-bound), the policy mixes them and beats both, in the time the cost model predicts."""
    store, tokens, _ = stored
    gbps = 0.02  # raw: 3.3 ms a fetch against 0.1 ms to decode; compact: 0.3 ms against 4 ms
    res = virtual_load(store, tokens, gbps=gbps, policy=FASTEST, recompute_s_per_token=1.0)
    singles = {lv: virtual_load(store, tokens, gbps=gbps, policy=lv, recompute_s_per_token=1.0).load_s for lv in (0, 1)}
    assert set(res.choices) == {RAW, COMPACT}, res.choices
    assert res.load_s < min(singles.values()), (res.load_s, singles)
    infos = store.plan(tokens)
    chunks = [PlanChunk(i.ref.index, i.ref.start, CHUNK, VALUES, i.sizes) for i in infos]
    predicted = simulate(chunks, res.choices, lambda _i: gbps, costs(1.0))
    assert res.load_s == pytest.approx(predicted, rel=0.05)


def test_a_fault_still_degrades_to_recompute(stored):
    store, tokens, kv = stored
    clock = VirtualClock()
    model = ToyModel(s_per_token=0.001, sleep=clock.sleep)
    loader = StreamingLoader(
        FaultyStore(store, {2: "corrupt"}),
        ladder(clock.sleep),
        model.recompute,
        LoaderOptions(policy=FASTEST, slo_s=None, values_per_token=VALUES // CHUNK),
        costs=costs(0.001),
        link=ThrottledLink(constant(10.0), clock=clock, sleep=clock.sleep),
        estimator=ThroughputEstimator(prior_gbps=10.0, min_bytes=0),
        clock=clock,
        runner=VirtualRunner(clock),
    )
    res = loader.load(tokens)
    assert len(res.faults) == 1 and res.choices[:2] == [RAW, RAW] and res.choices[2:] == [TEXT] * (N_CHUNKS - 2)
    assert all(torch.allclose(a.k, b.k) for a, b in zip(res.kv.layers, kv.layers))  # raw is exact here


def test_useful_options_drop_a_format_beaten_on_bytes_and_decode():
    c = PlanChunk(0, 0, CHUNK, VALUES, {0: 8000, 1: 600, 2: 900})
    cm = CostModel(decode_s_per_mvalue={0: 0.01, 1: 1.0, 2: 2.0}, recompute_s_per_token=100.0)
    assert useful_options(c, cm) == [0, 1, TEXT]  # level 2 is bigger and slower than level 1
    p = choose_fastest([c] * 3, 1e-6, cm, PipelineState(float("inf")))
    assert p.choice == 1  # a near-dead link: the fewest bytes
