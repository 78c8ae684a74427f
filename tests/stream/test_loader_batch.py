"""Chunks that wait in the loader's queue are decoded in one call (the codec's
``decode_many_into``): which chunks share a call, that the cache is the same, that a fault inside
a batch is found chunk by chunk and handled as without batching, and that a batched chunk's time
teaches the compute rates against its batched prediction. Toy codec and model, virtual time (the
first chunk's decode takes long enough for every fetch to queue), so the calls are exact."""

from __future__ import annotations

import logging

import pytest
import torch

from cachegen.errors import LoaderError
from cachegen.kv import KVCache
from cachegen.store import Namespace
from cachegen.stream import CostModel, LoaderOptions, StreamingLoader, VirtualClock, VirtualRunner
from cachegen.stream import loader as loader_mod
from cachegen.stream.costs import TEXT
from stream.fakes import BatchingToyCodec, FaultyStore, ToyCodec, ToyModel, stored_context

CHUNK = 32
N_TOKENS = 6 * CHUNK + 10  # six full chunks and a partial one
N_CHUNKS = 7
SHARE_S = 0.002


@pytest.fixture
def stored(tmp_path):
    model = ToyModel()
    tokens = [(7 * i + 3) % 101 for i in range(N_TOKENS)]
    kv = model.full(tokens, CHUNK)
    store = stored_context(tmp_path / "store", Namespace("toy-model", 1, "toy"), ToyCodec(), CHUNK, tokens, kv)
    yield model, store, tokens, kv
    store.backend.close()


def load(stored, policy=0, faults=None, costs=None, rates=None):
    """One load in virtual time; the plan counts each chunk's values (for the cost model)."""
    model, store, tokens, _ = stored
    clock = VirtualClock()
    codec = BatchingToyCodec(clock.sleep, share_s=SHARE_S)
    src = FaultyStore(store, faults or {})
    kv = stored[3]
    opts = LoaderOptions(policy=policy, slo_s=None, values_per_token=kv.num_values // kv.num_tokens)
    loader = StreamingLoader(
        src, codec, model.recompute, opts, costs=costs, rates=rates, clock=clock, runner=VirtualRunner(clock)
    )
    return loader.load(tokens), codec


def same(a: KVCache, b: KVCache) -> None:
    assert (a.start, a.end) == (b.start, b.end)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def test_the_chunks_that_waited_decode_in_one_call(stored):
    kv = stored[3]
    res, codec = load(stored)
    assert codec.calls == [("decode", 1), ("many", N_CHUNKS - 1)]
    assert not res.faults and res.choices == [0] * N_CHUNKS
    same(res.kv, kv)  # lossless
    batch = res.decisions[1:]
    assert {(d.decode_start, d.decode_end) for d in batch} == {(1.0, 1.0 + SHARE_S * 6)}
    # the call's time shared by tokens: 32 of 170 for each full chunk, 10 for the last
    assert [d.decode_s for d in batch] == pytest.approx([SHARE_S * 6 * 32 / 170] * 5 + [SHARE_S * 6 * 10 / 170])
    assert res.decode_s == pytest.approx(1.0 + SHARE_S * 6)


def test_only_consecutive_chunks_of_one_level_share_a_call(stored, monkeypatch):
    _, store, tokens, _ = stored
    levels = [0, 0, 1, 1, 1, 0, 0]
    monkeypatch.setattr(
        loader_mod._Load, "choose", lambda self, plan, k, prev, costs: (levels[plan.order[k]], 1.0, None)
    )
    res, codec = load(stored)
    # chunk 0 alone (it allocates the cache); then the runs of one level among those waiting
    assert codec.calls == [("decode", 1), ("into", 1), ("many", 3), ("many", 2)]
    assert res.choices == levels and not res.faults
    toy = ToyCodec()
    infos = store.plan(tokens)
    want = KVCache.concat([toy.decode(store.get(i.ref, lv), key=i.ref.key) for i, lv in zip(infos, levels)])
    same(res.kv, want)


def test_a_corrupt_chunk_in_a_batch_is_found_chunk_by_chunk(stored):
    model, _, tokens, kv = stored
    res, codec = load(stored, faults={3: "corrupt"})
    # the batch fails at chunk 3; chunks 1 and 2 are decoded again alone, chunk 3 fails: nothing after it
    assert codec.calls == [("decode", 1), ("many", 6), ("into", 1), ("into", 1), ("into", 1)]
    assert res.choices == [0, 0, 0] + [TEXT] * 4
    assert len(res.faults) == 1 and "chunk 3" in res.faults[0] and "checksum" in res.faults[0]
    assert [d.reason for d in res.decisions[3:]] == ["fault"] + ["after fault"] * 3
    good = kv.slice(0, 3 * CHUNK)
    same(res.kv, KVCache.concat([good, model.recompute(good, tokens[3 * CHUNK :])]))


def test_a_failed_fetch_ends_the_batch_before_it(stored):
    model, _, tokens, kv = stored
    res, codec = load(stored, faults={3: "missing"})
    assert codec.calls == [("decode", 1), ("many", 2)]  # chunks 1 and 2; the message after them is the fault
    assert res.choices == [0, 0, 0] + [TEXT] * 4 and len(res.faults) == 1
    good = kv.slice(0, 3 * CHUNK)
    same(res.kv, KVCache.concat([good, model.recompute(good, tokens[3 * CHUNK :])]))


def test_a_call_teaches_the_rates_against_its_first_chunk_alone_and_the_others_batched(stored):
    """The toy call of six chunks takes exactly what the batched model predicts for their shares.
    The pipeline model prices a call's first chunk alone (ten times slower here) and the others
    at their share, so the ratio each chunk teaches is the call's: 170 tokens of share against 32
    tokens alone and 138 of share."""
    kv = stored[3]
    vpt = kv.num_values // kv.num_tokens
    share_per_mvalue = SHARE_S * 6 / (N_TOKENS - CHUNK) / vpt * 1e6
    costs = CostModel(
        decode_s_per_mvalue={0: 10 * share_per_mvalue},
        decode_batched_s_per_mvalue={0: share_per_mvalue},
        decode_fixed_s=0.0,
    )
    rates = loader_mod.ComputeRates()
    load(stored, costs=costs, rates=rates)
    assert rates.factor(0) == pytest.approx(170 / (10 * 32 + 138))
    alone = loader_mod.ComputeRates()
    load(stored, costs=CostModel(decode_s_per_mvalue={0: 10 * share_per_mvalue}, decode_fixed_s=0.0), rates=alone)
    assert alone.factor(0) == pytest.approx(0.2)  # 0.1, at the ratio's floor


def test_a_failed_batch_of_two_is_decoded_again_chunk_by_chunk_and_traced(stored, monkeypatch, caplog):
    model, _, tokens, kv = stored
    levels = [0, 0, 0, 0, 0, 1, 1]  # chunks 1-4 share a call, then 5 and 6 another
    monkeypatch.setattr(
        loader_mod._Load, "choose", lambda self, plan, k, prev, costs: (levels[plan.order[k]], 1.0, None)
    )
    caplog.set_level(logging.DEBUG, logger="cachegen.stream.loader")
    res, codec = load(stored, faults={5: "corrupt"})
    assert codec.calls == [("decode", 1), ("many", 4), ("many", 2), ("into", 1)]
    assert res.choices == [0] * 5 + [TEXT] * 2 and len(res.faults) == 1 and "chunk 5" in res.faults[0]
    good = kv.slice(0, 5 * CHUNK)
    same(res.kv, KVCache.concat([good, model.recompute(good, tokens[5 * CHUNK :])]))
    traces = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(traces) == 2 and all("CorruptChunk" in t for t in traces)  # the batch's failure, then chunk 5's


class _Foreign:
    """The store, except that chunk 3's payload is chunk 3's values written for another key."""

    def __init__(self, store, kv: KVCache):
        self.store, self.kv = store, kv

    def plan(self, tokens, **kw):
        return self.store.plan(tokens)

    def get(self, ref, level, **kw):
        if ref.index == 3:
            return ToyCodec().encode(self.kv.slice(ref.start, ref.end), level, key="a-foreign-key")
        return self.store.get(ref, level)


def test_a_chunk_written_for_another_key_is_refused_inside_a_batch(stored):
    model, store, tokens, kv = stored
    clock = VirtualClock()
    codec = BatchingToyCodec(clock.sleep)
    opts = LoaderOptions(policy=0, slo_s=None)
    loader = StreamingLoader(
        _Foreign(store, kv), codec, model.recompute, opts, clock=clock, runner=VirtualRunner(clock)
    )
    res = loader.load(tokens)
    assert codec.calls == [("decode", 1), ("many", 6), ("into", 1), ("into", 1), ("into", 1)]
    assert res.choices == [0, 0, 0] + [TEXT] * 4 and "another key" in res.faults[0]


def test_the_batch_calls_refuse_ranges_that_do_not_fit(stored):
    model, store, tokens, kv = stored
    refs = [i.ref for i in store.plan(tokens)]
    clock = VirtualClock()
    loader = StreamingLoader(store, BatchingToyCodec(clock.sleep), model.recompute)
    slot = KVCache.allocate(kv, N_TOKENS)
    datas = [store.get(r, 0) for r in refs]
    with pytest.raises(LoaderError, match=r"^slot \[0, 202\) is not the range of chunks \[1, 2\]$"):
        loader.decode_many_into(datas[1:3], refs[1:3], slot)
    with pytest.raises(LoaderError, match=r"^slot \[1, 64\) is not the range of chunks \[0, 1\]$"):
        loader.decode_many_into(datas[:2], refs[:2], slot.slice(1, 64))
    with pytest.raises(LoaderError, match=r"^chunks \[0, 2\] are not consecutive$"):
        loader.decode_many_into([datas[0], datas[2]], [refs[0], refs[2]], slot.slice(0, 96))
    with pytest.raises(LoaderError, match=r"^the codec decodes one chunk at a time \(no decode_many_into\)$"):
        StreamingLoader(store, ToyCodec(), model.recompute).decode_many_into(datas[:1], refs[:1], slot.slice(0, 32))
    loader.decode_many_into(datas[1:3], refs[1:3], slot.slice(32, 96))
    same(slot.slice(32, 96), kv.slice(32, 96))
    cache = loader_mod._Cache(N_TOKENS, None)
    with pytest.raises(LoaderError, match=r"^a batch of chunks is decoded only after the first chunk$"):
        cache.decode_many(loader, datas[1:3], refs[1:3])


def test_a_fetched_chunk_is_booked_at_its_batched_cost_only_behind_one_of_its_level(stored, monkeypatch):
    """The fetch stage books a chunk's compute batched when the chunk before it in fetch order took
    its level, the codec decodes batches and compute is still committed."""
    levels = [0, 0, 1, 1, 0, 0, 0]
    monkeypatch.setattr(
        loader_mod._Load, "choose", lambda self, plan, k, prev, costs: (levels[plan.order[k]], 1.0, None)
    )
    joins: list[bool] = []
    real = loader_mod._Load.book

    def book(self, pos, chunk, choice, costs, joins=False):
        seen.append(joins)
        return real(self, pos, chunk, choice, costs, joins=joins)

    seen = joins
    monkeypatch.setattr(loader_mod._Load, "book", book)
    load(stored)
    assert joins == [False, True, False, True, False, True, True]


def test_booking_and_predictions_take_the_batched_cost_only_when_asked(stored):
    model, store, tokens, _ = stored
    costs = CostModel(decode_s_per_mvalue={0: 1.0}, decode_batched_s_per_mvalue={0: 0.25}, decode_fixed_s=0.0)
    chunk = loader_mod.PlanChunk(0, 0, 32, 1_000_000, {0: 1})
    assert loader_mod._Load.predicted(costs, chunk, 0) == pytest.approx(1.0)
    assert loader_mod._Load.predicted(costs, chunk, 0, True) == pytest.approx(0.25)
    scaled = loader_mod.ComputeRates()
    scaled.observe(0, 1.0, 2.0)  # decodes of level 0 take twice their prediction
    corrected = scaled.corrected(costs)
    assert corrected.decode_s(0, 1_000_000) == pytest.approx(2.0)
    assert corrected.decode_s(0, 1_000_000, batched=True) == pytest.approx(0.5)
    clock = VirtualClock()

    def booked(codec, joins: bool, busy: float) -> float:
        loader = StreamingLoader(store, codec, model.recompute, costs=costs, clock=clock)
        run = loader_mod._Load(loader, tokens, None, clock())
        if busy:
            run.cpu.queued(busy)
        run.book(0, chunk, 0, costs, joins=joins)
        return run.booked[0]

    batching = BatchingToyCodec(clock.sleep)
    assert booked(batching, True, 0.5) == pytest.approx(0.25)
    assert booked(batching, False, 0.5) == pytest.approx(1.0)  # after another level: alone
    assert booked(batching, True, 0.0) == pytest.approx(1.0)  # nothing to wait behind: alone
    assert booked(ToyCodec(), True, 0.5) == pytest.approx(1.0)  # a codec that cannot batch
    rates = loader_mod.ComputeRates()
    loader = StreamingLoader(store, batching, model.recompute, costs=costs, rates=rates, clock=clock)
    loader_mod._Load(loader, tokens, None, clock()).measured(chunk, 0, 0.5)  # alone: against 1.0
    assert rates.factor(0) == pytest.approx(0.5)
