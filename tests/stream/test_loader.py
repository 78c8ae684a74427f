"""The streaming loader on the real local store, with a toy codec and a toy model."""

from __future__ import annotations

import itertools

import pytest
import torch

from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import (
    CostModel,
    LoaderOptions,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    VirtualClock,
    VirtualRunner,
    constant,
    step,
)
from cachegen.stream.costs import TEXT
from stream.fakes import FaultyStore, ToyCodec, ToyModel, stored_context

CHUNK = 32
N_TOKENS = 6 * CHUNK + 10  # six full chunks and a partial one


@pytest.fixture
def setup(tmp_path):
    model = ToyModel()
    codec = ToyCodec()
    tokens = [(7 * i + 3) % 101 for i in range(N_TOKENS)]
    ns = Namespace("toy-model", 1, "toy")
    kv = model.full(tokens, CHUNK)
    store = stored_context(tmp_path / "store", ns, codec, CHUNK, tokens, kv)
    yield model, codec, store, tokens, kv
    store.backend.close()


COLLABORATORS = ("costs", "link", "estimator", "clock", "runner")


def make_loader(store, codec, recompute, **kw) -> StreamingLoader:
    """A loader from one set of keywords: collaborators go to the constructor, the rest into LoaderOptions."""
    collab = {k: kw.pop(k) for k in COLLABORATORS if k in kw}
    return StreamingLoader(store, codec, recompute, LoaderOptions(**kw), **collab)


def assert_same(a: KVCache, b: KVCache, atol=0.0):
    assert (a.start, a.end) == (b.start, b.end)
    for x, y in zip(a.layers, b.layers):
        assert torch.allclose(x.k.float(), y.k.float(), atol=atol) and torch.allclose(
            x.v.float(), y.v.float(), atol=atol
        )


def test_lossless_load_equals_cache(setup):
    model, codec, store, tokens, kv = setup
    loader = make_loader(store, codec, model.recompute, policy=0)
    longer = loader.load([*tokens, 1, 2, 3])  # the partial last chunk's key covers other tokens
    assert longer.cached_tokens == 6 * CHUNK
    res = loader.load(tokens)
    assert res.cached_tokens == N_TOKENS
    assert res.choices == [0] * 7 and not res.faults
    assert_same(res.kv, kv)
    assert model.calls[-1] != (0, 0) and len(model.calls) == 7  # only the fixture's own calls
    assert [d.bytes for d in res.decisions] == [i.sizes[0] for i in store.plan(tokens)]
    assert all(d.fetch_start is not None and d.fetch_start <= d.fetch_end <= d.decode_start for d in res.decisions)


def test_nothing_cached(setup):
    model, codec, store, _tokens, _kv = setup
    res = make_loader(store, codec, model.recompute).load([500, 501, 502] * 20)
    assert res.kv is None and res.cached_tokens == 0 and res.decisions == []


def test_lossy_levels_close(setup):
    model, codec, store, tokens, kv = setup
    res = make_loader(store, codec, model.recompute, policy=2).load(tokens)
    assert res.choices == [2] * 7
    assert_same(res.kv, kv, atol=0.05)


def test_text_policy_equals_recompute(setup):
    model, codec, store, tokens, kv = setup
    res = make_loader(store, codec, model.recompute, policy=TEXT).load(tokens)
    assert res.choices == [TEXT] * 7
    assert_same(res.kv, kv)


@pytest.mark.parametrize("fault", ["corrupt", "missing", "timeout"])
@pytest.mark.parametrize("at", [0, 3])
def test_fault_recomputes_rest(setup, fault, at):
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {at: fault})
    res = make_loader(faulty, codec, model.recompute, policy=0).load(tokens)
    assert len(res.faults) == 1 and f"chunk {at}" in res.faults[0]
    assert res.choices == [0] * at + [TEXT] * (7 - at)
    assert res.decisions[at].reason == "fault"
    # lossless before the fault, recomputed after it: exactly the cache a run without the store gives
    assert_same(res.kv, kv)
    # the rest was recomputed in one call on top of the good prefix
    assert model.calls[-1] == (at * CHUNK, N_TOKENS - at * CHUNK)


def test_fault_after_lossy_prefix_never_keeps_bad_chunk(setup):
    model, codec, store, tokens, _kv = setup
    faulty = FaultyStore(store, {2: "corrupt"})
    res = make_loader(faulty, codec, model.recompute, policy=3).load(tokens)
    good = KVCache.concat([codec.decode(store.get(i.ref, 3)) for i in store.plan(tokens)[:2]])
    expect = KVCache.concat([good, model.recompute(good, tokens[2 * CHUNK :])])
    assert_same(res.kv, expect)


class _KeylessCodec:
    """Decodes without checking the key (a codec that predates key binding): only the loader's
    own position check can catch a swapped chunk."""

    def __init__(self, codec):
        self.codec, self.levels = codec, codec.levels

    def decode(self, data):
        return self.codec.decode(data)


@pytest.mark.parametrize("keyed", [True, False])
def test_wrong_position_is_a_fault(setup, keyed):
    model, codec, store, tokens, kv = setup

    class Shifted(FaultyStore):
        def get(self, ref, level, *, timeout=None):
            if ref.index == 2:  # valid bytes, but of chunk 1
                return self.store.get(self.store.plan(tokens)[1].ref, level)
            return self.store.get(ref, level)

    res = make_loader(Shifted(store), codec if keyed else _KeylessCodec(codec), model.recompute, policy=0).load(tokens)
    assert res.decisions[2].reason == "fault" and len(res.faults) == 1
    if keyed:  # the chunk carries its key's digest
        assert "KeyMismatch" in res.faults[0]
    else:  # the loader checks the decoded position against the plan
        assert "expected [64, 96)" in res.faults[0]
    assert_same(res.kv, kv)


def test_missing_in_plan_is_recomputed_and_later_chunks_fetched(setup, tmp_path):
    model, codec, store, tokens, kv = setup
    refs = [i.ref for i in store.plan(tokens)]
    store.backend.clear()
    store.put_context(tokens, kv, levels=[0])
    # drop chunk 2 by storing everything else in a fresh store
    other = ContextStore(open_backend(f"file://{tmp_path / 'other'}"), store.namespace, codec, chunk_tokens=CHUNK)
    from cachegen.store import ChunkWrite, token_bytes

    raw = token_bytes(tokens)
    other.backend.put_chunks(
        [
            ChunkWrite(r.key, raw[r.start * 4 : r.end * 4], {0: store.get(r, 0)}, start=r.start)
            for r in refs
            if r.index != 2
        ]
    )
    res = make_loader(other, codec, model.recompute, policy="adaptive", slo_s=10).load(tokens)
    assert res.decisions[2].choice == TEXT and res.decisions[2].reason == "not stored"
    assert all(d.choice != TEXT for k, d in enumerate(res.decisions) if k != 2)
    assert_same(res.kv, kv, atol=0.02)
    other.backend.close()


def test_pipeline_overlaps_fetch_and_decode(setup):
    model, _codec, store, tokens, _kv = setup
    slow_codec = ToyCodec(delay_s_per_mvalue=15.0)  # ~0.03 s per chunk, sleeping (releases the GIL)
    link = ThrottledLink(constant(0.0005))  # 0.5 Mbit/s: level 1 chunk (~2 KB) ~0.03 s
    res = make_loader(store, slow_codec, model.recompute, policy=1, link=link, slo_s=None).load(tokens)
    ds = res.decisions
    # chunk i+1 was being fetched while chunk i was decoding
    overlaps = sum(
        1 for a, b in itertools.pairwise(ds) if b.fetch_start < a.decode_end and b.fetch_end > a.decode_start
    )
    assert overlaps >= 4
    # and nothing decoded before it arrived
    assert all(d.decode_start >= d.fetch_end for d in ds)


def test_adaptive_meets_deadline_and_reacts_to_drop(setup):
    """In virtual time (a 0.12 s deadline is too tight for a busy machine's thread scheduling): the
    loader itself, with decode (2 ms a chunk) and recompute (1 ms a token) taking virtual time."""
    _, _, store, tokens, _kv = setup
    clock = VirtualClock()
    codec = ToyCodec(delay_s_per_mvalue=0.002 / (2 * 2 * 2 * CHUNK * 8 / 1e6), sleep=clock.sleep)
    model = ToyModel(s_per_token=1e-3, sleep=clock.sleep)
    # 1 Gbps then 1 Mbps from chunk 3
    link = ThrottledLink(step(6, before=1.0, after=0.001), clock=clock, sleep=clock.sleep)
    est = ThroughputEstimator(prior_gbps=1.0, min_bytes=0)
    costs = CostModel(fetch_latency_s=0.0005, recompute_s_per_token=1e-3)
    slo = 0.12
    # in chunk order (no recency boost: with it the last chunk, on the slow side, is fetched first)
    loader = make_loader(
        store,
        codec,
        model.recompute,
        costs=costs,
        link=link,
        estimator=est,
        slo_s=slo,
        recency_boost=0,
        clock=clock,
        runner=VirtualRunner(clock),
    )
    res = loader.load(tokens)
    assert not res.faults, res.faults
    ch = res.choices
    assert ch[0] == 0  # plenty of bandwidth: lossless
    # chunk 3 is the first slow one; from chunk 4 on the estimate has dropped, and lossless
    # (8 KB, ~66 ms at 1 Mbps) no longer fits the ~50 ms left
    assert res.decisions[4].est_gbps < 0.01
    assert all(c == TEXT or c >= 1 for c in ch[4:]), ch
    assert res.load_s <= slo + 0.05, res.summary()


def test_rule_policy_equal_share(setup):
    model, codec, store, tokens, _kv = setup
    clock = VirtualClock()  # a 70 ms deadline: in virtual time, so a busy machine cannot miss it
    link = ThrottledLink(constant(0.002), clock=clock, sleep=clock.sleep)  # 2 Mbps
    est = ThroughputEstimator(prior_gbps=0.002, min_bytes=0)
    loader = make_loader(
        store,
        codec,
        model.recompute,
        link=link,
        estimator=est,
        policy="rule",
        slo_s=0.07,
        costs=CostModel(fetch_latency_s=0.0),
        clock=clock,
        runner=VirtualRunner(clock),
    )
    res = loader.load(tokens)
    # share 0.01 s = 2.5 KB at 2 Mbps: lossless (~8 KB) never fits, the smallest levels do
    assert 0 not in res.choices and TEXT not in res.choices, res.choices
    res = loader.load(tokens, slo_s=7.0)  # share 1 s: lossless everywhere
    assert res.choices == [0] * 7


def test_result_json(setup):
    model, codec, store, tokens, _kv = setup
    res = make_loader(store, codec, model.recompute, policy=1).load(tokens)
    d = res.to_json()
    assert d["cached_tokens"] == N_TOKENS and len(d["decisions"]) == 7
    assert {"index", "choice", "bytes", "fetch_s", "decode_s", "est_gbps"} <= set(d["decisions"][0])
    assert "L1" in res.summary()


def test_real_codec_through_local_store(tmp_path):
    """The project's codec (self-contained tables) and the local store, with a fault."""
    from cachegen.codec import Codec

    codec = Codec(None)
    model = ToyModel(layers=2, heads=2, head_dim=16)
    tokens = [(11 * i + 5) % 97 for i in range(4 * CHUNK)]
    kv = model.full(tokens, CHUNK)
    store = ContextStore(
        open_backend(f"file://{tmp_path / 's'}"), Namespace("toy", 1, "none"), codec, chunk_tokens=CHUNK
    )
    store.put_context(tokens, kv, levels=[0, 1])
    try:
        res = make_loader(store, codec, model.recompute, policy=0).load(tokens)
        assert res.choices == [0] * 4 and not res.faults
        assert_same(res.kv, kv)  # level 0 is bit-exact
        res = make_loader(FaultyStore(store, {1: "corrupt"}), codec, model.recompute, policy=1).load(tokens)
        assert res.choices[1:] == [TEXT] * 3 and res.faults
        good = codec.decode(store.get(store.plan(tokens)[0].ref, 1))
        assert_same(res.kv, KVCache.concat([good, model.recompute(good, tokens[CHUNK:])]))
    finally:
        store.backend.close()


def test_cold_estimator_probes_then_persists_across_loads(setup):
    model, codec, store, tokens, _kv = setup
    est = ThroughputEstimator(min_bytes=0)  # no prior: cold
    # the probe's ~600 bytes take 5 µs on the link, so its measured rate is the store's
    # first read (0.5-5 ms): a slow one made recomputing the next chunk (42 ms at the default cost)
    # look sooner than fetching it. Recompute is made dear: what is tested is the probe, then the level.
    costs = CostModel(fetch_latency_s=0.0, recompute_s_per_token=0.05)
    loader = make_loader(
        store,
        codec,
        model.recompute,
        link=ThrottledLink(constant(1.0)),
        estimator=est,
        slo_s=5.0,
        costs=costs,
    )
    first = loader.load(tokens)
    sizes = store.plan(tokens)[0].sizes
    assert first.choices[0] == min(sizes, key=lambda l: (sizes[l], -l))  # the smallest payload: a probe
    assert first.choices[1] == 0  # then measured: lossless fits
    again = make_loader(
        store,
        codec,
        model.recompute,
        link=ThrottledLink(constant(1.0)),
        estimator=est,
        slo_s=5.0,
        costs=costs,
    ).load(tokens)
    assert again.choices[0] == 0  # the estimate carried over: no probe


def test_rule_after_text_probes_in_loader(setup):
    model, codec, store, tokens, _kv = setup
    est = ThroughputEstimator(prior_gbps=1e-6, min_bytes=0)  # believed far too slow: text first
    res = make_loader(
        store,
        codec,
        model.recompute,
        link=ThrottledLink(constant(1.0)),
        estimator=est,
        policy="rule",
        slo_s=1.0,
        costs=CostModel(fetch_latency_s=0.0),
    ).load(tokens)
    assert res.choices[0] == TEXT and res.choices[1] != TEXT  # not stranded on text
    assert TEXT not in res.choices[2:], res.choices


def _warm_adaptive(store, codec, model, **kw):
    """An adaptive loader with a warm estimator on a fast link: it fetches the last chunk first."""
    est = ThroughputEstimator(prior_gbps=1.0, min_bytes=0)
    return make_loader(
        store,
        codec,
        model.recompute,
        link=ThrottledLink(constant(1.0)),
        estimator=est,
        slo_s=5.0,
        costs=CostModel(fetch_latency_s=0.0),
        **kw,
    )


def test_adaptive_fetches_the_last_chunk_first(setup):
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store)  # records the fetch order
    res = _warm_adaptive(faulty, codec, model).load(tokens)
    assert [i for i, _ in faulty.gets] == [6, 0, 1, 2, 3, 4, 5]
    assert res.choices == [0] * 7 and not res.faults  # generous deadline: lossless everywhere
    assert_same(res.kv, kv)
    plain = FaultyStore(store)
    _warm_adaptive(plain, codec, model, recency_boost=0).load(tokens)
    assert [i for i, _ in plain.gets] == list(range(7))


@pytest.mark.parametrize("fault", ["corrupt", "missing", "timeout"])
def test_fault_on_the_early_last_chunk_recomputes_only_it(setup, fault):
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {6: fault})
    res = _warm_adaptive(faulty, codec, model).load(tokens)
    assert len(res.faults) == 1 and "chunk 6" in res.faults[0]
    assert res.choices == [0] * 6 + [TEXT] and res.decisions[6].reason == "fault"
    assert [i for i, _ in faulty.gets] == [6, 0, 1, 2, 3, 4, 5]  # the rest was still fetched
    assert model.calls[-1] == (6 * CHUNK, N_TOKENS - 6 * CHUNK)  # recomputed on top of the others
    assert_same(res.kv, kv)


def test_planned_recompute_of_the_last_chunk_waits_for_the_others(setup):
    model, codec, store, tokens, kv = setup
    est = ThroughputEstimator(prior_gbps=1e-6, min_bytes=0)  # a dead link: recompute beats any fetch
    res = make_loader(
        store,
        codec,
        model.recompute,
        link=ThrottledLink(constant(1.0)),
        estimator=est,
        slo_s=5.0,
        costs=CostModel(fetch_latency_s=0.0),
    ).load(tokens)
    assert res.decisions[6].choice == TEXT and res.decisions[6].reason == "planned"
    assert_same(res.kv, kv, atol=0.05)
